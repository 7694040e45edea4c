"""The explain() report: what ran where, over a backend's graph records."""

from __future__ import annotations

import collections

import torch.fx

from ..reasons import Placement, Reason
from . import html
from .records import CLOSE_CALL, GraphRecord, GroupInfo, close_call, ort_optimizer_text


class ExplainReport:
    """What ran where: returned by ``lort.explain``. ``str(report)`` is a table of the
    graphs, their ORT groups and the nodes left to PyTorch with their reasons;
    ``save_html`` draws the same as one self-contained page. ``records`` holds each
    graph's full record."""

    def __init__(self, records: list[GraphRecord]):
        self.records = list(records)

    @property
    def graphs(self) -> list[torch.fx.GraphModule]:
        """The captured ATen graphs (``torch.fx.GraphModule``), one per compiled graph."""
        return [r.graph_module for r in self.records]

    @property
    def groups(self) -> list[GroupInfo]:
        """Every ORT fusion group of every graph: nodes, inputs, outputs, threads, executor, times."""
        return [g for r in self.records for g in r.groups]

    @property
    def ort_nodes(self) -> int:
        """How many ATen nodes run in ORT groups."""
        return sum(r.ort_nodes for r in self.records)

    @property
    def torch_nodes(self) -> int:
        """How many ATen nodes stay in PyTorch."""
        return sum(r.torch_nodes for r in self.records)

    @property
    def fallbacks(self) -> list[tuple[str, str]]:
        """``(op, reason)`` for every ATen node left to PyTorch."""
        return [f for r in self.records for f in r.fallbacks]

    @property
    def fallback_kinds(self) -> collections.Counter:
        """How many ATen nodes stayed in PyTorch, by ReasonKind."""
        return collections.Counter(r.kind for _, r in self.fallbacks if isinstance(r, Reason))

    @property
    def ort_fraction(self) -> float:
        """The share of ATen nodes in ORT: ``ort_nodes / (ort_nodes + torch_nodes)``, 0.0 for none."""
        total = self.ort_nodes + self.torch_nodes
        return self.ort_nodes / total if total else 0.0

    def save_html(self, path, layout: str = "auto") -> str:
        """Write one self-contained HTML page (inline CSS and SVG, no URL) drawing each
        captured graph, ORT groups as coloured boxes, nodes left to PyTorch with their
        reasons, and per group its inputs, outputs, threads, executor, times, ORT fusions
        and disk-cache origin. ``layout``: "auto" (graphviz's ``dot`` where installed,
        else networkx), "dot" or "networkx". Returns ``path``."""
        return html.write(self, path, layout)

    def __str__(self) -> str:
        lines = [
            f"lort explain: {len(self.records)} graph(s), {len(self.groups)} ORT group(s), "
            f"{self.ort_nodes} ATen nodes in ORT, {self.torch_nodes} in PyTorch "
            f"({100 * self.ort_fraction:.1f}% in ORT)",
            "",
            f"{'graph':<24} {'kind':<10} {'groups':>6} {'ort':>6} {'torch':>6}",
        ]
        for r in self.records:
            line = f"{r.name:<24} {r.kind:<10} {len(r.groups):>6} {r.ort_nodes:>6} {r.torch_nodes:>6}"
            if r.executor_times:
                t = r.executor_times
                where = {Placement.PYTORCH: "eager PyTorch", Placement.INDUCTOR: "inductor"}.get(r.executor, "lort")
                lort_time = "lort's cheapest call" if t.get("floor") else "lort"
                timed = [f"{t[k] * 1e3:.3f} ms {name}" for k, name in
                         (("ort", lort_time), ("pytorch", "eager"), ("inductor", "inductor")) if t.get(k)]
                line += f"  runs through {where} (timed {', '.join(timed)})"
                if close_call(t) and not t.get("floor") and r.executor != Placement.INDUCTOR:
                    line += f" [close call: within {CLOSE_CALL:.0%}; another process may choose otherwise]"
            lines.append(line)
        notes = [(r.name, note) for r in self.records for note in r.engine_notes]
        if notes:
            lines += ["", "engines not timed:"] + [f"  {name}: {note}" for name, note in notes]
        if self.groups:
            lines += [
                "", f"{'group':<28} {'nodes':>6} {'inputs':>7} {'frozen':>7} {'outputs':>8} {'threads':>8}  ORT fusions"
            ]
            for g in self.groups:
                times = ", ".join(f"{k}: {v * 1e6:.0f}us" for k, v in g.thread_times.items() if v is not None)
                threads = f"{g.threads}" + (f" ({times})" if times else "")
                fusions = ", ".join(f"{k} x{v}" for k, v in g.fusions.items()) or "-"
                where = "" if g.executor == Placement.ORT else "  [runs in PyTorch]"
                if close_call(g.executor_times):
                    t = g.executor_times
                    where += (f"  [close call, ORT {t['ort'] * 1e6:.0f}us vs PyTorch {t['pytorch'] * 1e6:.0f}us: "
                              "another process may choose otherwise]")
                elif g.executor_times and "pytorch" not in g.executor_times:
                    least = g.executor_times.get("ort_lower_bound")
                    long = "a long run" if least is None else f"its products alone take at least {least:.2f} s a run"
                    where += f"  [{long}: timed against eager PyTorch as part of its graph, not alone]"
                kept = "; ".join(f"{c} weight(s) kept as inputs: {why}" for why, c in g.kept_inputs.items())
                lines.append(
                    f"{g.name:<28} {g.num_nodes:>6} {g.num_inputs:>7} {g.frozen:>7} {g.num_outputs:>8} {threads:>8}  "
                    f"{fusions}{where}" + (f"  [{kept}]" if kept else "")
                )
                if g.ort_optimizer:
                    lines.append(f"{'':<4}ORT's optimizer: {ort_optimizer_text(g.ort_optimizer)}")
        # A graph that runs whole in eager PyTorch or inductor has one reason for all its
        # nodes: one line.
        whole = (Placement.PYTORCH, Placement.INDUCTOR)
        fallbacks = [f for r in self.records if r.executor not in whole for f in r.fallbacks]
        for engine, title in ((Placement.PYTORCH, "eager PyTorch"), (Placement.INDUCTOR, "inductor")):
            graphs = [r for r in self.records if r.executor == engine]
            if graphs:
                lines += ["", f"graphs run whole in {title}:"]
            for r in graphs:
                reason = r.fallbacks[0][1] if r.fallbacks else "executor='auto'"
                lines.append(f"  {r.name} ({r.torch_nodes} nodes): {reason}")
        if fallbacks:
            kinds = collections.Counter(r.kind for _, r in fallbacks if isinstance(r, Reason))
            by_kind = ", ".join(f"{k.value} {c}" for k, c in kinds.most_common())
            lines += ["", f"left to PyTorch (by kind: {by_kind}):", f"{'count':>6}  {'op':<40} reason"]
            counts = collections.Counter(fallbacks)
            for (op, reason), c in counts.most_common():
                lines.append(f"{c:>6}  {op:<40} {reason}")
        return "\n".join(lines)

    __repr__ = __str__
