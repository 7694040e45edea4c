"""Records of what lort did with each captured graph: one ``GraphRecord`` per ATen
graph, one ``GroupInfo`` per ORT group (the explain report and the HTML page read them)."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx

from ..fusion.input_views import DUPLICATE
from ..reasons import Placement, Reason, ReasonKind
from ..runtime.memory import give_back_memory


#: Two timings closer than this (relative) are a close call: the choice between them may
#: differ from one process to the next (the tuner times such a pair again; explain says so).
CLOSE_CALL = 0.05


def close_call(times: dict) -> bool:
    """Whether ``times`` (``{"ort": s, "pytorch": s}``) are within CLOSE_CALL of each other."""
    ort, pytorch = times.get("ort"), times.get("pytorch")
    return bool(ort and pytorch) and abs(pytorch / ort - 1.0) < CLOSE_CALL


def is_aten_node(node: torch.fx.Node) -> bool:
    """An operator call counted in reports (tuple indexing is not an op, nor the PyTorch
    copy of a view whose original ORT runs: fusion/input_views.py)."""
    return node.op == "call_function" and node.target is not operator.getitem and not node.meta.get(DUPLICATE)


@dataclasses.dataclass
class GroupInfo:
    name: str
    num_nodes: int
    num_inputs: int
    num_outputs: int
    ops: list[str]
    #: ORT intra-op threads chosen, and the timings (seconds) it was chosen by.
    threads: int | None = None
    thread_times: dict = dataclasses.field(default_factory=dict)
    #: onnxscript ORT fusion rewrites that fired, by name.
    fusions: dict = dataclasses.field(default_factory=dict)
    #: Where the group runs (PYTORCH when executor="auto" timed it faster there, or ORT
    #: failed to run it) and those timings in seconds.
    executor: Placement = Placement.ORT
    executor_times: dict = dataclasses.field(default_factory=dict)
    #: Weights frozen into the group's sessions as ORT initializers (Options.freeze),
    #: and the weights that stayed inputs, counted by why.
    frozen: int = 0
    kept_inputs: dict = dataclasses.field(default_factory=dict)
    #: How ORT's own optimizer changed the group's graph, per op type (nodes added > 0,
    #: removed < 0); recorded by lort.explain (Options.record_ort_graph), else empty.
    ort_optimizer: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class GraphRecord:
    """One AOTAutograd graph: 'forward', 'backward' or 'inference'."""

    kind: str
    name: str
    graph_module: torch.fx.GraphModule
    #: The graph as it runs: groups replaced by their modules (the HTML report draws it).
    partitioned: torch.fx.GraphModule | None = None
    groups: list[GroupInfo] = dataclasses.field(default_factory=list)
    ort_nodes: int = 0
    torch_nodes: int = 0
    #: (op, reason) of each ATen node left to PyTorch; a Reason is its text and a kind.
    fallbacks: list[tuple[str, Reason]] = dataclasses.field(default_factory=list)
    group_modules: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: ORT (through lort's compiled graph), PYTORCH when executor="auto" found the whole
    #: graph faster in eager PyTorch (compile/graph_executor.py), or INDUCTOR when it found
    #: it faster compiled by inductor (compile/engines.py), with the timings in seconds
    #: (keys "ort", "pytorch", "inductor").
    executor: Placement = Placement.ORT
    executor_times: dict = dataclasses.field(default_factory=dict)
    #: Why an engine of executor="auto" was not timed for this graph, or its timing
    #: failed (inductor's compile, a candidate that raised): explain and the HTML report
    #: show them beside the engine that runs.
    engine_notes: list[str] = dataclasses.field(default_factory=list)

    def ran_whole_in_pytorch(self, times: dict, cached: bool = False) -> None:
        """The graph this record belongs to runs in eager PyTorch: nothing of it in ORT."""
        self.executor, self.executor_times = Placement.PYTORCH, dict(times)
        if times.get("floor"):
            why = (
                f"eager PyTorch ran the whole graph in {times['pytorch'] * 1e3:.3f} ms, less than lort's cheapest "
                f"call ({times['ort'] * 1e3:.3f} ms, a one-op graph's); nothing compiled (executor='auto')"
            )
        elif times:
            why = (
                f"the whole graph ran faster in eager PyTorch ({times['pytorch'] * 1e3:.3f} ms vs "
                f"{times['ort'] * 1e3:.3f} ms through lort; executor='auto')"
            )
        else:
            why = "the whole graph ran faster in eager PyTorch (executor='auto')"
        if cached:
            why += ", read from the disk cache"
        self._ran_whole_outside(Placement.PYTORCH, Reason(ReasonKind.GRAPH_FASTER_IN_EAGER, why))

    def ran_whole_in_inductor(self, times: dict, cached: bool = False, compile_s: float | None = None) -> None:
        """The graph this record belongs to runs compiled by inductor (compile/engines.py)."""
        self.executor, self.executor_times = Placement.INDUCTOR, dict(times)
        others = ", ".join(f"{v * 1e3:.3f} ms {'through lort' if k == 'ort' else 'in eager PyTorch'}"
                           for k, v in times.items() if k in ("ort", "pytorch") and v)
        why = "the whole graph ran faster compiled by inductor"
        if times.get("inductor"):
            why += f" ({times['inductor'] * 1e3:.3f} ms" + (f" vs {others}" if others else "") + ")"
        if compile_s is not None:
            why += f"; inductor compiled it in {compile_s:.1f} s in the background"
        why += "; executor='auto'" + (", read from the disk cache" if cached else "")
        self._ran_whole_outside(Placement.INDUCTOR, Reason(ReasonKind.GRAPH_FASTER_IN_INDUCTOR, why))

    def _ran_whole_outside(self, where: Placement, reason: Reason) -> None:
        nodes = [n for n in self.graph_module.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
        self.fallbacks = [(_describe_target(n), reason) for n in nodes
                          if n.target is not operator.getitem and not n.meta.get(DUPLICATE)]
        self.torch_nodes, self.ort_nodes = len(self.fallbacks), 0
        for g in self.groups:
            g.executor = where
        # Their ORT sessions and frozen weights are freed now: what Dynamo or AOTAutograd
        # still holds of the compiled graph (for good) keeps only the groups' shells.
        for module in self.group_modules.values():
            module.release(for_good=True)
        if self.group_modules:
            give_back_memory()
        self.group_modules, self.partitioned = {}, None

    def group_failed_at_run(self, name: str, why: Reason) -> None:
        """Group ``name``, which ORT failed to run, runs in PyTorch from now on."""
        info = next((g for g in self.groups if g.name == name), None)
        if info is None or info.executor == Placement.PYTORCH:
            return
        info.executor = Placement.PYTORCH
        self.ort_nodes -= info.num_nodes
        self.torch_nodes += info.num_nodes
        self.fallbacks += [(op, why) for op in info.ops]

    def set_result(self, groups, modules: dict, unsupported: dict) -> None:
        """Fill the record from the fuser's ``groups``, their runtime ``modules`` (OrtGroup,
        by group name) and the ``unsupported`` nodes' reasons."""
        from ..fusion.support import op_name

        in_group = set()
        unsupported = dict(unsupported)
        for g in groups:
            mod = modules[g.name]
            if mod.executor == Placement.ORT:
                in_group.update(n for n in g.nodes if is_aten_node(n))
            info = GroupInfo(
                g.name,
                sum(1 for n in g.nodes if is_aten_node(n)),
                len(g.inputs),
                len(g.outputs),
                [op_name(n) for n in g.nodes if is_aten_node(n)],
                threads=mod.threads,
                thread_times=dict(mod.thread_times),
                fusions=dict(mod.fusions),
                executor=mod.executor,
                executor_times=dict(mod.executor_times),
                frozen=mod.frozen_count,
                kept_inputs=dict(mod.compiled.kept_inputs),
                ort_optimizer=dict(mod.compiled.ort_optimizer),
            )
            self.groups.append(info)
            if info.executor == Placement.PYTORCH:
                why = _group_in_pytorch(info.executor_times, mod.run_failure)
                for n in g.nodes:
                    if is_aten_node(n):
                        unsupported.setdefault(n, why)
        self.group_modules = dict(modules)
        left_alone = Reason(
            ReasonKind.LEFT_ALONE, "left alone by the fuser (a group of views only, or over max_group_args alone)"
        )
        for node in self.graph_module.graph.nodes:
            if not is_aten_node(node):
                continue
            if node in in_group:
                self.ort_nodes += 1
            else:
                self.torch_nodes += 1
                self.fallbacks.append((op_name(node), unsupported.get(node, left_alone)))

    def summary(self) -> str:
        total = self.ort_nodes + self.torch_nodes
        return (
            f"{self.name}: {len(self.groups)} ORT group(s), {self.ort_nodes}/{total} ATen nodes in ORT, "
            f"{self.torch_nodes} in PyTorch"
        )


def _group_in_pytorch(t: dict, run_failure: str | None) -> Reason:
    """Why a group's nodes run in PyTorch: ORT failed to run it (in this process or one
    the disk cache remembers), or executor="auto" timed it faster there."""
    if run_failure:
        return Reason(ReasonKind.RUN_FAILED, f"ORT failed to run its group: {run_failure}")
    if "pytorch" in t and "ort" in t:
        return Reason(
            ReasonKind.SLOWER_IN_ORT,
            f"its group ran faster in PyTorch ({t['pytorch'] * 1e6:.0f} us vs {t['ort'] * 1e6:.0f} us in ORT; "
            "executor='auto')",
        )
    return Reason(ReasonKind.SLOWER_IN_ORT, "its group runs in PyTorch (executor='auto')")


def _describe_target(node: torch.fx.Node) -> str:
    from ..fusion.support import op_name

    if node.op == "call_function":
        return op_name(node)
    return f"{node.op} {node.target}"


def ort_optimizer_text(changes: dict) -> str:
    """"+FusedConv x20, -BatchNormalization x20, ...": ops ORT's optimizer added first,
    then those it removed, most first."""
    added = sorted(((op, d) for op, d in changes.items() if d > 0), key=lambda x: (-x[1], x[0]))
    removed = sorted(((op, -d) for op, d in changes.items() if d < 0), key=lambda x: (-x[1], x[0]))
    return ", ".join([f"+{op} x{d}" for op, d in added] + [f"-{op} x{d}" for op, d in removed])
