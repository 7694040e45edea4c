"""The graph drawn for one GraphRecord in the HTML report: ORT groups collapsed to one
unit each, nodes left to PyTorch kept one by one (with their reasons), and the values
that pass between units as edges."""

from __future__ import annotations

import collections
import dataclasses
import operator

import torch
import torch.fx

from ..fusion.input_views import DUPLICATE
from ..reasons import Placement
from .records import GraphRecord, GroupInfo, is_aten_node

#: Above this many PyTorch units, connected PyTorch nodes are drawn as one unit.
MAX_TORCH_UNITS = 150
#: The reason set_result gives to the nodes of a group that ran faster in PyTorch.
_GROUP_IN_PYTORCH = "its group ran faster in PyTorch"


@dataclasses.dataclass
class Unit:
    """One box of the drawing."""

    id: str
    #: "group" (an ORT group), "group-pytorch" (a group timed faster in PyTorch),
    #: "torch" (nodes left to PyTorch) or "eager" (a graph run whole in eager PyTorch).
    kind: str
    title: str
    nodes: int
    ops: collections.Counter
    reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    group: GroupInfo | None = None
    inputs: list[str] = dataclasses.field(default_factory=list)
    outputs: list[str] = dataclasses.field(default_factory=list)
    graph_inputs: int = 0
    graph_outputs: int = 0
    from_cache: bool | None = None
    #: Position of the group among the record's groups (for its colour), or -1.
    index: int = -1
    #: Why a group runs in PyTorch.
    why: str | None = None


@dataclasses.dataclass
class DrawnGraph:
    record: GraphRecord
    units: list[Unit]
    #: (from unit id, to unit id) -> how many values pass.
    edges: dict[tuple[str, str], int]
    #: Distinct reasons for PyTorch nodes, numbered from 1 in the drawing.
    reasons: list[str]
    #: False when reasons could only be matched to nodes by op name.
    reasons_exact: bool = True


def short_op(name: str) -> str:
    """'aten.convolution_backward.default' -> 'convolution_backward'."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[0] in ("aten", "prims"):
        return parts[1] + ("" if parts[2] == "default" else f".{parts[2]}")
    return name


def describe_value(val) -> str:
    """'float32[2, 16, 8, 8]' for a (fake) tensor, the type name otherwise."""
    if isinstance(val, torch.Tensor):
        dims = ", ".join(str(d) for d in val.shape)
        return f"{str(val.dtype).replace('torch.', '')}[{dims}]"
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"{type(val).__name__} {val}"
    if val is None:
        return "?"
    return type(val).__name__


def _op_name(node: torch.fx.Node) -> str:
    from ..fusion.support import op_name

    if node.op == "call_function":
        return op_name(node)
    return f"{node.op} {node.target}"


def _node_reasons(record: GraphRecord, standalone: list[torch.fx.Node]) -> tuple[dict, list, bool]:
    """The reason of each node left standing alone in PyTorch, the other fallbacks (those
    of groups run in PyTorch), and whether the match is exact. ``record.fallbacks`` holds
    (op, reason) in graph order for every node outside an ORT group, the nodes of groups
    timed faster in PyTorch among them (told apart by their reason), those of a group ORT
    failed to run after them: the standalone nodes are matched in order."""
    reasons: dict[torch.fx.Node, str] = {}
    rest: list[tuple[str, str]] = []
    for op, reason in record.fallbacks:
        pos = len(reasons)
        if pos < len(standalone) and not reason.startswith(_GROUP_IN_PYTORCH) and op == _op_name(standalone[pos]):
            reasons[standalone[pos]] = reason
        else:
            rest.append((op, reason))
    if len(reasons) == len(standalone):
        return reasons, rest, True
    by_op: dict[str, str] = {}
    for op, reason in record.fallbacks:
        if not reason.startswith(_GROUP_IN_PYTORCH):
            by_op.setdefault(op, reason)
    return {n: by_op.get(_op_name(n), "not recorded") for n in standalone}, list(record.fallbacks), False


def _group_reasons(record: GraphRecord, rest: list[tuple[str, str]]) -> dict[str, str]:
    """Why each group run in PyTorch does: the recorded reason whose nodes' ops hold the
    group's ops."""
    by_reason: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for op, reason in rest:
        by_reason[reason][op] += 1
    found = {}
    for g in record.groups:
        if g.executor == Placement.ORT:
            continue
        need = collections.Counter(g.ops)
        for reason, have in by_reason.items():
            if not need - have:
                found[g.name] = reason
                by_reason[reason] = have - need
                break
        else:
            found[g.name] = "runs in PyTorch (no reason recorded)"
    return found


def _torch_unit(node: torch.fx.Node, reason: str) -> Unit:
    op = _op_name(node)
    return Unit(
        id=f"n_{node.name}",
        kind="torch",
        title=short_op(op),
        nodes=1,
        ops=collections.Counter([op]),
        reasons=collections.Counter([reason]),
    )


def build(record: GraphRecord) -> DrawnGraph:
    """The units and edges to draw for ``record``."""
    if record.executor in (Placement.PYTORCH, Placement.INDUCTOR):
        ops = collections.Counter(op for op, _ in record.fallbacks)
        reasons = collections.Counter(r for _, r in record.fallbacks)
        title = "whole graph in eager PyTorch" if record.executor == Placement.PYTORCH else "whole graph in inductor"
        unit = Unit("eager", "eager", title, record.torch_nodes, ops, reasons)
        return DrawnGraph(record, [unit], {}, sorted(reasons))
    gm = record.partitioned if record.partitioned is not None else record.graph_module
    groups = {g.name: (i, g) for i, g in enumerate(record.groups)}
    original = [n for n in record.graph_module.graph.nodes if is_aten_node(n)]
    standing = {n.name for n in gm.graph.nodes if is_aten_node(n)}
    standalone = [n for n in original if n.name in standing]
    reason_of, rest, exact = _node_reasons(record, standalone)
    reason_by_name = {n.name: r for n, r in reason_of.items()}
    group_reasons = _group_reasons(record, rest)

    units: dict[str, Unit] = {}
    unit_of: dict[torch.fx.Node, str | None] = {}
    edges: collections.Counter = collections.Counter()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            unit_of[node] = None
            continue
        if node.op == "output":
            for v in _flat(node.args):
                uid = unit_of.get(v)
                if uid is not None:
                    units[uid].graph_outputs += 1
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0]
            unit_of[node] = unit_of.get(src) if isinstance(src, torch.fx.Node) else None
            uid = unit_of[node]
            if uid is not None and units[uid].group is not None:
                units[uid].outputs.append(describe_value(node.meta.get("val")))
            continue
        if node.meta.get(DUPLICATE):  # PyTorch's copy of a view of an input ORT also takes: drawn as that input
            unit_of[node] = None
            continue
        name = node.meta.get("lort_group") if node.op == "call_module" else None
        if name in groups:
            index, info = groups[name]
            mod = record.group_modules.get(name)
            unit = Unit(
                id=f"g_{name}",
                kind="group" if info.executor == Placement.ORT else "group-pytorch",
                title=name,
                nodes=info.num_nodes,
                ops=collections.Counter(info.ops),
                group=info,
                inputs=[describe_value(a.meta.get("val")) for a in node.all_input_nodes],
                from_cache=mod.from_cache if mod is not None else None,
                index=index,
            )
            if info.executor != Placement.ORT:
                unit.why = group_reasons[name]
        else:
            unit = _torch_unit(node, reason_by_name.get(node.name, "not recorded"))
        units[unit.id] = unit
        unit_of[node] = unit.id
        for inp in node.all_input_nodes:
            src = unit_of.get(inp)
            if src is None:
                unit.graph_inputs += 1
            elif src != unit.id:
                edges[(src, unit.id)] += 1
    drawn = DrawnGraph(record, list(units.values()), dict(edges), [], exact)
    if sum(1 for u in drawn.units if u.kind == "torch") > MAX_TORCH_UNITS:
        _merge_torch_units(drawn)
    reasons = collections.Counter()
    for u in drawn.units:
        reasons.update(u.reasons)
    drawn.reasons = [r for r, _ in reasons.most_common()]
    return drawn


def _flat(args) -> list[torch.fx.Node]:
    out: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, lambda a: out.append(a))
    return out


def _merge_torch_units(drawn: DrawnGraph) -> None:
    """Connected PyTorch units become one unit each (a graph with hundreds of them)."""
    parent = {u.id: u.id for u in drawn.units if u.kind == "torch"}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in drawn.edges:
        if a in parent and b in parent:
            parent[find(a)] = find(b)
    merged: dict[str, Unit] = {}
    rename: dict[str, str] = {}
    units: list[Unit] = []
    for u in drawn.units:
        if u.kind != "torch":
            units.append(u)
            continue
        root = find(u.id)
        if root not in merged:
            merged[root] = Unit(f"m_{root}", "torch", "", 0, collections.Counter())
            units.append(merged[root])
        m = merged[root]
        m.nodes += u.nodes
        m.ops.update(u.ops)
        m.reasons.update(u.reasons)
        m.graph_inputs += u.graph_inputs
        m.graph_outputs += u.graph_outputs
        rename[u.id] = m.id
    for m in merged.values():
        m.title = short_op(m.ops.most_common(1)[0][0]) if len(m.ops) == 1 else "PyTorch nodes"
    edges: collections.Counter = collections.Counter()
    for (a, b), c in drawn.edges.items():
        a, b = rename.get(a, a), rename.get(b, b)
        if a != b:
            edges[(a, b)] += c
    drawn.units, drawn.edges = units, dict(edges)
