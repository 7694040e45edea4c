"""The fuser (seed 001, OrtFuser) over FX graphs.

Supported producer -> consumer pairs are merged into fusion groups until nothing
changes. A merge is refused when

* it would create a cycle in the quotient graph (each group contracted to one vertex):
  some path leads from one group to the other through a third unit, a PyTorch node or
  another group (the merged group could not be placed anywhere valid);
* it crosses a mutation: a node that mutates a tensor is ordered after every earlier
  reader or writer of that tensor or an alias of it and before every later one
  (``dependencies.py``), and those ordering edges count as paths like data edges do;
* the merged group would have more than ``max_args`` inputs plus outputs (a node or a
  multi-output node with its items over the limit on its own stays in PyTorch).

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

from .dependencies import DepGraph


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


class _Unit:
    """A group of supported nodes or one node left to PyTorch, at ``pos`` in a
    topological order of all units that the fuser keeps valid through every merge."""

    __slots__ = ("members", "pos", "fusible", "inputs", "outputs", "labels")

    def __init__(self, node: torch.fx.Node, pos: int, fusible: bool, label=None):
        self.members = {node}
        self.pos = pos
        self.fusible = fusible
        self.inputs = set(node.all_input_nodes)
        self.outputs = {node} if node.users else set()
        #: The ``apart`` labels of the members (at most one).
        self.labels = frozenset() if label is None else frozenset((label,))


class Fuser:
    """Merges supported nodes into groups while the quotient graph (each group
    contracted to one vertex, PyTorch nodes as they are) stays acyclic.

    Acyclicity is a property of the quotient graph, not of the nodes: two merges that
    are each fine node by node can close a cycle through a third group (group 0 feeds a
    PyTorch node feeding group 1, which feeds a PyTorch node feeding group 0). So the
    fuser keeps a topological order of the units (groups and PyTorch nodes), ``slots``,
    valid after every merge. Merging units A before B is possible iff no path leads from
    A to B through another unit; such a path only visits units placed between them, so
    the search is bounded by the two positions. After the merge, the units between them
    that A reaches move after the merged group, the others before it.
    """

    def __init__(
        self,
        graph: torch.fx.Graph,
        is_supported: Callable[[torch.fx.Node], bool],
        max_args: int = 128,
        free_inputs: set | frozenset = frozenset(),
        apart: Callable[[torch.fx.Node], object] | None = None,
    ):
        self.nodes = list(graph.nodes)
        self.deps = DepGraph(self.nodes)
        self.max_args = max_args
        #: Inputs that do not count towards max_args (weights frozen into the session).
        self.free_inputs = free_inputs
        self.unit: dict[torch.fx.Node, _Unit] = {}
        self.slots: list[_Unit | None] = []
        for i, n in enumerate(self.nodes):
            u = _Unit(n, i, n.op == "call_function" and bool(is_supported(n)), apart(n) if apart else None)
            self.unit[n] = u
            self.slots.append(u)
        # A multi-output node and its getitems are one unit from the start.
        for n in self.nodes:
            if n.target is operator.getitem and self.unit[n].fusible:
                src = n.args[0]
                if isinstance(src, torch.fx.Node) and self.unit[src].fusible:
                    self._merge(self.unit[src], self.unit[n], check_args=False)
        # A unit over the argument limit on its own (a node with many inputs, a
        # multi-output node with its items) stays in PyTorch.
        for u in self.slots:
            if u is not None and u.fusible and len(u.inputs - free_inputs) + len(u.outputs) > max_args:
                u.fusible = False

    @property
    def group_of(self) -> dict[torch.fx.Node, set[torch.fx.Node]]:
        """Each supported node's group (the same set object for all its members)."""
        return {n: u.members for n, u in self.unit.items() if u.fusible}

    # -- merging ------------------------------------------------------------------------
    def _boundary_of(self, a: _Unit, b: _Unit) -> tuple[set, set]:
        unit = self.unit
        inputs = {i for i in a.inputs | b.inputs if unit[i] is not a and unit[i] is not b}
        outputs = {
            o for o in a.outputs | b.outputs if any(unit[u] is not a and unit[u] is not b for u in o.users)
        }
        return inputs, outputs

    def _reached_between(self, a: _Unit, b: _Unit) -> list[_Unit] | None:
        """The units placed between ``a`` and ``b`` (a before b) that ``a`` reaches, or
        None if ``b`` is reached through one of them (merging would close a cycle)."""
        unit, succ = self.unit, self.deps.succ
        end = b.pos
        reached: dict[int, _Unit] = {}
        stack = [a]
        while stack:
            cur = stack.pop()
            for n in cur.members:
                for s in succ[n]:
                    v = unit[s]
                    if v.pos >= end or v is cur:
                        if v is b and cur is not a:
                            return None
                        continue
                    if id(v) not in reached:
                        reached[id(v)] = v
                        stack.append(v)
        return sorted(reached.values(), key=lambda v: v.pos)

    def _merge(self, x: _Unit, y: _Unit, check_args: bool = True) -> bool:
        if x is y:
            return False
        a, b = (x, y) if x.pos < y.pos else (y, x)
        if len(a.labels | b.labels) > 1:
            return False
        inputs, outputs = self._boundary_of(a, b)
        if check_args and len(inputs - self.free_inputs) + len(outputs) > self.max_args:
            return False
        moved = self._reached_between(a, b)
        if moved is None:
            return False
        lo, hi = a.pos, b.pos
        moved_ids = {id(v) for v in moved}
        stay = [v for v in self.slots[lo + 1 : hi] if v is not None and id(v) not in moved_ids]
        # b absorbs a, so that units after b never move.
        b.members |= a.members
        for n in a.members:
            self.unit[n] = b
        b.inputs, b.outputs = inputs, outputs
        b.labels = a.labels | b.labels
        order = stay + [b] + moved
        self.slots[lo : hi + 1] = [None] * (hi - lo + 1 - len(order)) + order
        for i in range(lo, hi + 1):
            v = self.slots[i]
            if v is not None:
                v.pos = i
        return True

    def try_merge(self, producer: torch.fx.Node, consumer: torch.fx.Node) -> bool:
        """Merge the groups of two supported nodes if the result is valid."""
        gp, gc = self.unit[producer], self.unit[consumer]
        if not (gp.fusible and gc.fusible):
            return False
        return self._merge(gp, gc)

    def run(self) -> list[set[torch.fx.Node]]:
        index = self.deps.index
        changed = True
        while changed:
            changed = False
            # Reverse topological scan: each consumer tries to absorb its producers.
            for n in reversed(self.nodes):
                if not self.unit[n].fusible:
                    continue
                for p in sorted(n.all_input_nodes, key=index.__getitem__, reverse=True):
                    if self.unit[p].fusible and self.try_merge(p, n):
                        changed = True
        # Then siblings: neighbouring groups with no path between them through another
        # unit (e.g. the independent gradient branches of a backward graph) are merged,
        # so a graph runs in fewer ORT calls.
        acc = None
        for g in self._unique():
            rep = next(iter(g))
            if acc is not None and self.try_merge(acc, rep):
                continue
            acc = rep
        return self._unique()

    def _unique(self) -> list[set[torch.fx.Node]]:
        index = self.deps.index
        groups = [u.members for u in self.slots if u is not None and u.fusible]
        return sorted(groups, key=lambda g: min(index[n] for n in g))


def find_groups(
    graph: torch.fx.Graph,
    is_supported: Callable[[torch.fx.Node], bool],
    max_args: int = 128,
    prefix: str = "ort_group",
    free_inputs: set | frozenset = frozenset(),
    apart: Callable[[torch.fx.Node], object] | None = None,
) -> list[FusionGroup]:
    """Partition ``graph``'s supported nodes into fusion groups (the graph is not changed).
    ``free_inputs`` do not count towards ``max_args``. ``apart``: a label per node (None:
    any group); nodes of different labels never share a group."""
    fuser = Fuser(graph, is_supported, max_args, free_inputs, apart)
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
        if _is_complex(inp):  # enters as float pairs (replace_groups' view_as_real)
            ph.meta = {"val": _real_view(inp.meta["val"])}
            env[inp] = g.call_function(_VIEW_AS_COMPLEX, (ph,))
            env[inp].meta = dict(inp.meta)
    for n in group.nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.is_conj():
            # ORT holds the values themselves: torch_lib's _conj negates the imaginary parts.
            env[n].meta = {**env[n].meta, "val": val.resolve_conj()}
    out_nodes = []
    for o in group.outputs:
        out = env[o]
        if _is_complex(o):  # leaves as float pairs (replace_groups' view_as_complex)
            resolved = g.call_function(_RESOLVE_CONJ, (out,))
            resolved.meta = {"val": o.meta["val"].resolve_conj()}
            out = g.call_function(_VIEW_AS_REAL, (resolved,))
            out.meta = {"val": _real_view(o.meta["val"])}
        out_nodes.append(out)
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


_VIEW_AS_REAL = torch.ops.aten.view_as_real.default
_VIEW_AS_COMPLEX = torch.ops.aten.view_as_complex.default
_RESOLVE_CONJ = torch.ops.aten.resolve_conj.default


def _is_complex(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype.is_complex


def _real_view(val: torch.Tensor) -> torch.Tensor:
    """The float pairs of a complex (fake) tensor, its conjugate bit resolved."""
    return torch.view_as_real(val.resolve_conj())


def _as_real(graph: torch.fx.Graph, arg: torch.fx.Node, original: torch.fx.Node) -> torch.fx.Node:
    """``arg`` as a group's input: a complex tensor as its float pairs (a view, after
    resolving a conjugate bit, which view_as_real refuses)."""
    if not _is_complex(original):
        return arg
    resolved = graph.call_function(_RESOLVE_CONJ, (arg,))
    resolved.meta = {"val": original.meta["val"].resolve_conj()}
    real = graph.call_function(_VIEW_AS_REAL, (resolved,))
    real.meta = {"val": _real_view(original.meta["val"])}
    return real


def schedule(graph: torch.fx.Graph, groups: list[FusionGroup]) -> list:
    """The order in which the groups (FusionGroup) and the other nodes (fx.Node) of
    ``graph`` run: topological over data and mutation-ordering edges, each unit as early
    as its first node allows."""
    nodes = list(graph.nodes)
    deps = DepGraph(nodes)
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
    return order


def replace_groups(
    gm: torch.fx.GraphModule,
    groups: list[FusionGroup],
    modules: dict[str, torch.nn.Module],
) -> torch.fx.GraphModule:
    """A new GraphModule where each group is one call_module (``modules[group.name]``,
    returning one value per ``group.outputs``), placed as ``schedule`` orders them."""
    nodes = list(gm.graph.nodes)
    order = schedule(gm.graph, groups)
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
            call = new_graph.call_module(u.name, tuple(_as_real(new_graph, env[i], i) for i in u.inputs))
            call.meta["lort_group"] = u.name
            for i, o in enumerate(u.outputs):
                item = new_graph.call_function(operator.getitem, (call, i))
                item.meta = dict(o.meta)
                if _is_complex(o):
                    item.meta = {"val": _real_view(o.meta["val"])}
                    item = new_graph.call_function(_VIEW_AS_COMPLEX, (item,))
                    item.meta = dict(o.meta)
                env[o] = item
        else:
            env[u] = new_graph.node_copy(u, lambda a: env[a])
    new_graph.lint()
    return torch.fx.GraphModule(root, new_graph, class_name=type(gm).__name__)
