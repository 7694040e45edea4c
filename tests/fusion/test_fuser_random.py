"""The fuser on random graphs: 1,000 seeded DAGs of supported and unsupported nodes,
in-place mutations (of inputs, of intermediates and of views) and multi-output nodes.

For every graph and several argument limits the partition must be acyclic (the quotient
graph of groups and PyTorch nodes is a DAG), keep every group within ``max_group_args``,
keep a multi-output node with its items, and keep mutation order: once the groups are
placed (``fuser.replace_groups``), a mutation and every other read or write of the same
storage run in their original relative order. A sample of the graphs also runs end to
end through lort (``executor="ort"``) against eager PyTorch.

Whether a node is supported follows its op: the ops in ``FORCED_OUT`` stand for nodes
ORT cannot run (the structural checks pass that predicate to ``fuser.find_groups``; the
end-to-end runs make lort's support check refuse them), mutations are never supported.
"""

from __future__ import annotations

import dataclasses
import operator
import random

import pytest
import torch
import torch.fx

import lort
from lort.fusion import fuser, support
from lort.reasons import Reason, ReasonKind

aten = torch.ops.aten

#: Ops that stand for unsupported nodes: a unary, a binary and a multi-output op.
FORCED_OUT = {aten.sin.default, aten.minimum.default, aten.max.dim}
UNARY = [aten.tanh.default, aten.cos.default, aten.neg.default, aten.relu.default, aten.sigmoid.default]
BINARY = [aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.maximum.default]
MUTATIONS = [aten.add_.Tensor, aten.mul_.Tensor, aten.copy_.default]
LIMITS = (2, 3, 6, 128)
N_GRAPHS = 1000
N_END_TO_END = 20


@dataclasses.dataclass
class Value:
    node: torch.fx.Node
    cols: int  # every value is (4, cols) float32
    storage: int


@dataclasses.dataclass
class RandomGraph:
    graph: torch.fx.Graph
    n_inputs: int
    #: node -> storages it reads, and the storage a mutation writes.
    reads: dict
    writes: dict


def random_graph(seed: int, max_ops: int = 30) -> RandomGraph:
    rng = random.Random(seed)
    g = torch.fx.Graph()
    p_out = rng.choice([0.0, 0.15, 0.3, 0.6])  # share of unsupported ops
    n_inputs = rng.randint(1, 4)
    values: list[Value] = []
    reads: dict = {}
    writes: dict = {}
    storages = iter(range(10**6))
    for i in range(n_inputs):
        values.append(Value(g.placeholder(f"x{i}"), 6, next(storages)))

    def pick(cols=None) -> Value:
        pool = [v for v in values if cols is None or v.cols == cols or v.cols == 1]
        # Recent values more often: deeper chains.
        return pool[min(len(pool) - 1, int(len(pool) * rng.random() ** 0.5))]

    def call(target, args, ins, cols, storage=None, kwargs=None) -> Value:
        node = g.call_function(target, tuple(args), kwargs or {})
        reads[node] = {v.storage for v in ins}
        v = Value(node, cols, next(storages) if storage is None else storage)
        values.append(v)
        return v

    def forced(op_supported, op_unsupported):
        return op_unsupported if rng.random() < p_out else op_supported

    for _ in range(rng.randint(2, max_ops)):
        kind = rng.choices(["unary", "binary", "multi", "split", "cat", "view", "mutate"], [6, 6, 2, 1, 1, 1, 3])[0]
        if kind == "unary":
            a = pick()
            call(forced(rng.choice(UNARY), aten.sin.default), [a.node], [a], a.cols)
        elif kind == "binary":
            a = pick()
            b = pick(a.cols)
            call(forced(rng.choice(BINARY), aten.minimum.default), [a.node, b.node], [a, b], max(a.cols, b.cols))
        elif kind == "multi":
            a = pick()
            if rng.random() < p_out:
                mo = call(aten.max.dim, [a.node, 1, True], [a], 1)
                vals = call(operator.getitem, [mo.node, 0], [mo], 1)
                if rng.random() < 0.5:
                    idx = call(operator.getitem, [mo.node, 1], [mo], 1)
                    call(aten._to_copy.default, [idx.node], [idx], 1, kwargs={"dtype": torch.float32})
                    values.remove(idx)  # int64: only its float copy is used
                values.remove(mo)
            else:
                mo = call(aten.var_mean.correction, [a.node, [1]], [a], 1, kwargs={"correction": 0, "keepdim": True})
                for k in rng.sample([0, 1], rng.randint(1, 2)):
                    call(operator.getitem, [mo.node, k], [mo], 1)
                values.remove(mo)
        elif kind == "split":
            a = pick()
            if a.cols % 2 == 0 and a.cols > 1:
                sp = call(aten.split.Tensor, [a.node, a.cols // 2, 1], [a], a.cols // 2, storage=a.storage)
                for k in range(2):
                    call(operator.getitem, [sp.node, k], [sp], a.cols // 2, storage=a.storage)
                values.remove(sp)
        elif kind == "cat":
            parts = [pick() for _ in range(rng.randint(2, 4))]
            if sum(p.cols for p in parts) <= 12:
                call(aten.cat.default, [[p.node for p in parts], 1], parts, sum(p.cols for p in parts))
        elif kind == "view":
            a = pick()
            if a.cols > 1:
                end = rng.randint(1, a.cols - 1)
                call(aten.slice.Tensor, [a.node, 1, 0, end], [a], end, storage=a.storage)
        else:  # an in-place op on an input, an intermediate or a view
            targets = [v for v in values if v.cols > 1]
            if not targets:
                continue
            t = rng.choice(targets)
            src = pick(t.cols)
            op = rng.choice(MUTATIONS)
            m = call(op, [t.node, src.node], [t, src], t.cols, storage=t.storage)
            writes[m.node] = t.storage
    # Every value nothing uses is an output (nothing is dead), and some others.
    outs = [v.node for v in values[n_inputs:] if not v.node.users or rng.random() < 0.3]
    g.output(tuple(dict.fromkeys(outs)))
    return RandomGraph(g, n_inputs, reads, writes)


def is_supported(node: torch.fx.Node) -> bool:
    """The predicate the structural checks fuse with (lort's rules for these ops)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return is_supported(node.args[0])
    return node.target not in FORCED_OUT and not node.target._schema.is_mutable


# -- structural checks ---------------------------------------------------------------


def check_partition(rg: RandomGraph, groups: list[fuser.FusionGroup], limit: int) -> None:
    nodes = list(rg.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    group_of = {}
    for grp in groups:
        assert len(grp.inputs) + len(grp.outputs) <= limit, f"{grp.name}: over max_group_args={limit}"
        for n in grp.nodes:
            assert n not in group_of, f"{n} in two groups"
            assert is_supported(n), f"unsupported {n} in {grp.name}"
            group_of[n] = grp.name
        for n in grp.nodes:  # a multi-output node and its items stay together
            if n.target is operator.getitem:
                assert n.args[0] in grp.nodes
            for u in n.users:
                if u.target is operator.getitem:
                    assert u in grp.nodes
    # The quotient graph (data edges between groups and single nodes) is a DAG.
    unit = {n: group_of.get(n, n) for n in nodes}
    succ: dict = {u: set() for u in unit.values()}
    indeg = {u: 0 for u in unit.values()}
    for n in nodes:
        for p in n.all_input_nodes:
            a, b = unit[p], unit[n]
            if a != b and b not in succ[a]:
                succ[a].add(b)
                indeg[b] += 1
    ready = [u for u, d in indeg.items() if d == 0]
    seen = 0
    while ready:
        u = ready.pop()
        seen += 1
        for s in succ[u]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    assert seen == len(succ), "the quotient graph has a cycle"
    # Mutation order, in the order the groups and other nodes run (as replace_groups
    # places them; the end-to-end tests run replace_groups' graphs).
    where = {}
    for pos, u in enumerate(fuser.schedule(rg.graph, groups)):
        for n in u.nodes if isinstance(u, fuser.FusionGroup) else [u]:
            where[n] = pos
    assert set(where) == set(nodes)
    for m, storage in rg.writes.items():
        for other in nodes:
            if other is m or storage not in rg.reads.get(other, ()):
                continue
            before = index[other] < index[m]
            assert where[other] != where[m] and (where[other] < where[m]) == before, (
                f"{other.name} {'before' if before else 'after'} mutation {m.name} originally, not after partitioning"
            )


def test_random_partitions_are_valid():
    n_groups = n_mut = 0
    for seed in range(N_GRAPHS):
        rg = random_graph(seed)
        n_mut += len(rg.writes)
        for limit in LIMITS:
            try:
                groups = fuser.find_groups(rg.graph, is_supported, max_args=limit)
                check_partition(rg, groups, limit)
            except AssertionError as e:
                raise AssertionError(f"graph seed {seed}, max_group_args={limit}: {e}\n{rg.graph}") from e
            n_groups += len(groups)
    # The generator really makes groups and mutations (a check that cannot fail otherwise).
    assert n_groups > N_GRAPHS and n_mut > N_GRAPHS // 2


def test_cycle_through_two_groups_is_refused():
    """index_reduce(prod)'s backward, the graph that made the fuser build a cycle: the
    two groups each feed an unsupported node that feeds the other. Merging node by node
    saw no cycle."""
    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    a1 = g.call_function(aten.neg.default, (x,))
    b1 = g.call_function(aten.neg.default, (y,))
    u1 = g.call_function(aten.sin.default, (a1,))  # group A -> PyTorch -> group B
    u2 = g.call_function(aten.sin.default, (b1,))  # group B -> PyTorch -> group A
    a2 = g.call_function(aten.add.Tensor, (a1, u2))
    b2 = g.call_function(aten.add.Tensor, (b1, u1))
    g.output((a2, b2))
    rg = RandomGraph(g, 2, {}, {})
    for limit in LIMITS:
        check_partition(rg, fuser.find_groups(g, is_supported, max_args=limit), limit)


# -- end to end -----------------------------------------------------------------------


def _forced_out_reason(original):
    def unsupported_reason(node):
        if node.op == "call_function" and node.target in FORCED_OUT:
            return Reason(ReasonKind.NO_TRANSLATION, "forced out of ORT by test_fuser_random")
        return original(node)

    return unsupported_reason


def _end_to_end_seeds():
    """Graphs with unsupported nodes, mutations and multi-output nodes, small enough to
    compile quickly: the first N_END_TO_END seeds past 10_000 that qualify."""
    seeds, seed = [], 10_000
    while len(seeds) < N_END_TO_END:
        rg = random_graph(seed, max_ops=14)
        targets = {n.target for n in rg.graph.nodes if n.op == "call_function"}
        if targets & FORCED_OUT and (rg.writes or len(seeds) % 2) and targets - FORCED_OUT:
            seeds.append(seed)
        seed += 1
    return seeds


@pytest.mark.parametrize("seed", _end_to_end_seeds())
def test_random_graph_end_to_end(seed, monkeypatch):
    rg = random_graph(seed, max_ops=14)
    monkeypatch.setattr(support, "unsupported_reason", _forced_out_reason(support.unsupported_reason))
    gm = torch.fx.GraphModule(torch.nn.Module(), rg.graph)
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(4, 6, generator=gen) for _ in range(rg.n_inputs)]
    eager_in = [t.clone() for t in inputs]
    expected = gm(*eager_in)
    backend = lort.LortBackend({"executor": "ort", "mode": "ort", "max_group_args": random.Random(seed).choice(LIMITS)})
    lort_in = [t.clone() for t in inputs]
    got = torch.compile(gm, backend=backend, fullgraph=True)(*lort_in)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(lort_in, eager_in, rtol=1e-5, atol=1e-5, equal_nan=True)
    # lort split the graph as told: the forced-out nodes ran in PyTorch, and every other
    # node in ORT unless the fuser left it alone (a group of views only, or over the
    # argument limit alone), it is a view of an input that PyTorch consumes (taken there,
    # fusion/input_views.py) or it is a broadcasting copy (known wrong in torch_lib).
    reasons = [reason for r in backend.records for _, reason in r.fallbacks]
    assert any("forced out" in reason for reason in reasons), reasons
    allowed = ("forced out", "left alone by the fuser", "a view of the graph's input", "torch_lib's copy is CastLike")
    assert all(any(a in reason for a in allowed) for reason in reasons), reasons


@pytest.fixture
def index_reduce_whole(monkeypatch):
    """index_reduce kept whole (lort decomposes it into scatter_reduce, all in ORT), so its
    backward graph is again the one whose PyTorch nodes made the fuser build a cycle."""
    from lort.capture import decompositions
    from lort.capture.decompositions import indexing as decompositions_indexing

    own = decompositions_indexing.table
    monkeypatch.setattr(decompositions_indexing, "table",
                        lambda: {op: fn for op, fn in own().items() if op != torch.ops.aten.index_reduce.default})
    decompositions.table.cache_clear()
    yield
    decompositions.table.cache_clear()


def test_index_reduce_prod_end_to_end(index_reduce_whole):
    """The op whose backward graph made the fuser build a cycle (issue 11), against eager:
    output and the gradients of the input and the source, zeros included."""
    x = torch.randn(5, 3)
    x[1, 1] = 0
    src = torch.randn(4, 3)
    src[2, 0] = 0
    index = torch.tensor([0, 2, 0, 4])

    def fn(x, src):
        return x.index_reduce(0, index, src, "prod", include_self=True)

    backend = lort.LortBackend({"executor": "ort", "mode": "ort"})
    got_in = [x.clone().requires_grad_(), src.clone().requires_grad_()]
    exp_in = [x.clone().requires_grad_(), src.clone().requires_grad_()]
    got = torch.compile(fn, backend=backend)(*got_in)
    expected = fn(*exp_in)
    weight = torch.randn(5, 3)
    (got * weight).sum().backward()
    (expected * weight).sum().backward()
    torch.testing.assert_close(got, expected)
    for g, e in zip(got_in, exp_in):
        torch.testing.assert_close(g.grad, e.grad)
    backward = [r for r in backend.records if r.kind == "backward"]
    assert backward and len(backward[0].groups) >= 2, [r.summary() for r in backend.records]
