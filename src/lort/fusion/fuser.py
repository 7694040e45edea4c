"""The fuser (seed 001, OrtFuser) over FX graphs.

Supported producer -> consumer pairs are merged into fusion groups until nothing
changes. A merge is refused when

* it would create a cycle: some path leaves the two groups through a node outside
  them and comes back (the merged group could not be placed anywhere valid);
* it crosses a mutation: a node that mutates a tensor is ordered after every earlier
  reader of that tensor and before every later one, and those ordering edges count as
  paths like data edges do;
* the merged group would have more than ``max_args`` inputs plus outputs.

A group made only of view ops is dissolved (it would only copy in ORT). Each group
then becomes a GraphModule of its own, cleaned by dead-code elimination, common
subexpression elimination and pooling of identical inputs.
"""

from __future__ import annotations

import dataclasses
import heapq
import operator
from typing import Callable, Iterable

import torch
import torch.fx


@dataclasses.dataclass
class FusionGroup:
    """Nodes of the parent graph that run together, with their boundary values."""

    name: str
    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node]
    outputs: list[torch.fx.Node]


def is_view_op(node: torch.fx.Node) -> bool:
    target = node.target
    if target is operator.getitem:
        return True
    if isinstance(target, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in target._schema.returns) or target in _VIEW_LIKE
    return False


_VIEW_LIKE = {torch.ops.aten._unsafe_view.default}


def _mutated_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    out = []
    schema = target._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node):
                out.append(value)
    return out


class _DepGraph:
    """Data edges plus the ordering edges that mutations impose, all index-increasing."""

    def __init__(self, nodes: list[torch.fx.Node]):
        self.index = {n: i for i, n in enumerate(nodes)}
        self.succ: dict[torch.fx.Node, set[torch.fx.Node]] = {n: set() for n in nodes}
        self.pred: dict[torch.fx.Node, set[torch.fx.Node]] = {n: set() for n in nodes}
        for n in nodes:
            for p in n.all_input_nodes:
                self._add(p, n)
        for m in nodes:
            for tensor in _mutated_args(m):
                for user in tensor.users:
                    if user is m:
                        continue
                    if self.index[user] < self.index[m]:
                        self._add(user, m)
                    else:
                        self._add(m, user)

    def _add(self, a: torch.fx.Node, b: torch.fx.Node) -> None:
        if a is b:
            return
        self.succ[a].add(b)
        self.pred[b].add(a)


def _boundary(members: set[torch.fx.Node], ordered: Iterable[torch.fx.Node]):
    inputs: dict[torch.fx.Node, None] = {}
    outputs: list[torch.fx.Node] = []
    for n in ordered:
        for a in n.all_input_nodes:
            if a not in members:
                inputs.setdefault(a, None)
        if any(u not in members for u in n.users):
            outputs.append(n)
    return list(inputs), outputs


class Fuser:
    def __init__(
        self,
        graph: torch.fx.Graph,
        is_supported: Callable[[torch.fx.Node], bool],
        max_args: int = 128,
    ):
        self.nodes = list(graph.nodes)
        self.deps = _DepGraph(self.nodes)
        self.max_args = max_args
        supported = [n for n in self.nodes if n.op == "call_function" and is_supported(n)]
        self.group_of: dict[torch.fx.Node, set[torch.fx.Node]] = {}
        for n in supported:
            self.group_of[n] = {n}
        # A multi-output node and its getitems are one unit from the start.
        for n in supported:
            if n.target is operator.getitem:
                src = n.args[0]
                if src in self.group_of and self.group_of[src] is not self.group_of[n]:
                    self._union(self.group_of[src], self.group_of[n])

    def _union(self, a: set, b: set) -> set:
        if len(a) < len(b):
            a, b = b, a
        a |= b
        for n in b:
            self.group_of[n] = a
        return a

    def _creates_cycle(self, merged: set[torch.fx.Node]) -> bool:
        index = self.deps.index
        hi = max(index[n] for n in merged)
        stack = [
            s
            for n in merged
            for s in self.deps.succ[n]
            if s not in merged and index[s] < hi
        ]
        seen = set(stack)
        while stack:
            cur = stack.pop()
            for s in self.deps.succ[cur]:
                if s in merged:
                    return True
                if s not in seen and index[s] < hi:
                    seen.add(s)
                    stack.append(s)
        return False

    def _arg_count(self, merged: set[torch.fx.Node]) -> int:
        inputs, outputs = _boundary(merged, merged)
        return len(inputs) + len(outputs)

    def try_merge(self, producer: torch.fx.Node, consumer: torch.fx.Node) -> bool:
        gp, gc = self.group_of[producer], self.group_of[consumer]
        if gp is gc:
            return False
        merged = gp | gc
        if self._arg_count(merged) > self.max_args:
            return False
        if self._creates_cycle(merged):
            return False
        self._union(gp, gc)
        return True

    def run(self) -> list[set[torch.fx.Node]]:
        changed = True
        while changed:
            changed = False
            # Reverse topological scan: each consumer tries to absorb its producers.
            for n in reversed(self.nodes):
                if n not in self.group_of:
                    continue
                for p in sorted(n.all_input_nodes, key=self.deps.index.__getitem__, reverse=True):
                    if p in self.group_of and self.try_merge(p, n):
                        changed = True
        # Then siblings: neighbouring groups with no path between them through a node
        # outside both (e.g. the independent gradient branches of a backward graph) are
        # merged, so a graph runs in fewer ORT calls.
        acc = None
        for g in self._unique():
            rep = next(iter(g))
            if acc is not None and self.try_merge(acc, rep):
                continue
            acc = rep
        return self._unique()

    def _unique(self) -> list[set[torch.fx.Node]]:
        unique: dict[int, set[torch.fx.Node]] = {}
        for g in self.group_of.values():
            unique[id(g)] = g
        index = self.deps.index
        return sorted(unique.values(), key=lambda g: min(index[n] for n in g))


def find_groups(
    graph: torch.fx.Graph,
    is_supported: Callable[[torch.fx.Node], bool],
    max_args: int = 128,
    prefix: str = "ort_group",
) -> list[FusionGroup]:
    """Partition ``graph``'s supported nodes into fusion groups (the graph is not changed)."""
    fuser = Fuser(graph, is_supported, max_args)
    index = fuser.deps.index
    groups = []
    for members in fuser.run():
        if all(is_view_op(n) for n in members):
            continue
        ordered = sorted(members, key=index.__getitem__)
        inputs, outputs = _boundary(members, ordered)
        groups.append(FusionGroup(f"{prefix}_{len(groups)}", ordered, inputs, outputs))
    return groups


def _cse_key(node: torch.fx.Node):
    def freeze(a):
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(freeze(x) for x in a))
        if isinstance(a, dict):
            return tuple(sorted((k, freeze(v)) for k, v in a.items()))
        if isinstance(a, torch.fx.Node):
            return ("node", a)
        return (type(a).__name__, a)

    return (node.target, freeze(node.args), freeze(node.kwargs))


def cse(gm: torch.fx.GraphModule) -> int:
    """Common subexpression elimination of side-effect-free calls; returns nodes removed."""
    seen: dict = {}
    removed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and (
            target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags
        ):
            continue
        try:
            key = _cse_key(node)
            hash(key)
        except TypeError:
            continue
        if key in seen:
            node.replace_all_uses_with(seen[key])
            gm.graph.erase_node(node)
            removed += 1
        else:
            seen[key] = node
    return removed


def build_group_module(owner: torch.fx.GraphModule, group: FusionGroup) -> tuple[torch.fx.GraphModule, list[int]]:
    """A GraphModule computing ``group.outputs`` from ``group.inputs``.

    Returns the module and, for each of ``group.outputs``, the index of the module output
    that holds it (CSE can make two group outputs the same value).
    """
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, inp in enumerate(group.inputs):
        ph = g.placeholder(f"in_{i}_{inp.name}")
        ph.meta = dict(inp.meta)
        env[inp] = ph
    for n in group.nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    out_nodes = [env[o] for o in group.outputs]
    g.output(tuple(out_nodes))
    gm = torch.fx.GraphModule(owner, g, class_name=group.name)
    cse(gm)
    gm.graph.eliminate_dead_code()
    # Pool outputs that CSE made identical.
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    values = list(out_node.args[0])
    unique: list[torch.fx.Node] = []
    where: list[int] = []
    for v in values:
        if v in unique:
            where.append(unique.index(v))
        else:
            where.append(len(unique))
            unique.append(v)
    out_node.args = (tuple(unique),)
    gm.graph.lint()
    gm.recompile()
    return gm, where


def replace_groups(
    gm: torch.fx.GraphModule,
    groups: list[FusionGroup],
    modules: dict[str, torch.nn.Module],
) -> torch.fx.GraphModule:
    """A new GraphModule where each group is one call_module (``modules[group.name]``,
    returning one value per ``group.outputs``), placed topologically."""
    nodes = list(gm.graph.nodes)
    deps = _DepGraph(nodes)
    index = deps.index
    unit_of: dict[torch.fx.Node, object] = {n: n for n in nodes}
    for grp in groups:
        for n in grp.nodes:
            unit_of[n] = grp
    units: dict[int, object] = {}
    for u in unit_of.values():
        units[id(u)] = u

    def members(u):
        return u.nodes if isinstance(u, FusionGroup) else [u]

    first = {id(u): min(index[n] for n in members(u)) for u in units.values()}
    indeg = {id(u): 0 for u in units.values()}
    succ: dict[int, set[int]] = {id(u): set() for u in units.values()}
    for a, bs in deps.succ.items():
        ua = id(unit_of[a])
        for b in bs:
            ub = id(unit_of[b])
            if ua != ub and ub not in succ[ua]:
                succ[ua].add(ub)
                indeg[ub] += 1
    heap = [(first[k], k) for k, d in indeg.items() if d == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, k = heapq.heappop(heap)
        order.append(units[k])
        for s in succ[k]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, (first[s], s))
    if len(order) != len(units):  # pragma: no cover - the fuser refuses cycles
        raise AssertionError("lort fuser produced a cyclic partition")

    new_graph = torch.fx.Graph()
    root = torch.nn.Module()
    for name, mod in gm.named_children():
        root.add_module(name, mod)
    for name, buf in gm.named_buffers(recurse=False):
        root.register_buffer(name, buf)
    for name, p in gm.named_parameters(recurse=False):
        root.register_parameter(name, p)
    for n in nodes:
        if n.op == "get_attr" and "." not in n.target and not hasattr(root, n.target):
            setattr(root, n.target, getattr(gm, n.target))
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for u in order:
        if isinstance(u, FusionGroup):
            root.add_module(u.name, modules[u.name])
            call = new_graph.call_module(u.name, tuple(env[i] for i in u.inputs))
            call.meta["lort_group"] = u.name
            for i, o in enumerate(u.outputs):
                item = new_graph.call_function(operator.getitem, (call, i))
                item.meta = dict(o.meta)
                env[o] = item
        else:
            env[u] = new_graph.node_copy(u, lambda a: env[a])
    new_graph.lint()
    return torch.fx.GraphModule(root, new_graph, class_name=type(gm).__name__)
