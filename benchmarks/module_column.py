"""The lort.ORTModule column of benchmarks/run.py's inference rows (``python -m benchmarks
speed``, issue 13).

``lort.ORTModule(model)`` called under no_grad takes its direct inference path
(Options.direct_inference: torch.export capture, no Dynamo per call), while the "lort"
column is ``torch.compile(model, backend="lort")``, which pays Dynamo's guards on every
call. Both compile the same ATen graph with frozen weights.
"""

from __future__ import annotations

import copy

import torch

import lort
from report import geomean
from timing import first_call_seconds

#: run.py's name for it, in a row's times.
MODULE = "lort_module"
HEADER_CELLS = " ORTModule ms | ORTModule vs eager | ORTModule vs inductor | ORTModule vs whole ORT |"
HEADER_RULE = "---:|---:|---:|---:|"


def module_step(model: torch.nn.Module, args: tuple, per_call: bool = True):
    """A step calling ``lort.ORTModule`` over a copy of ``model`` under no_grad, entered
    on each call (``per_call``) or by the caller around the measurement."""
    om = lort.ORTModule(copy.deepcopy(model))

    def step():
        with torch.no_grad():
            return om(*args)

    if not per_call:
        def step():  # noqa: F811 - the caller holds no_grad
            return om(*args)

    step.module = om
    return step


def add_module_step(steps: dict, firsts: dict, model: torch.nn.Module, args: tuple, sync=lambda: None,
                    per_call: bool = True) -> None:
    """Add ORTModule's step to ``steps`` and its first call (export, compile, first run)
    to ``firsts``."""
    step = module_step(model, args, per_call)
    firsts[MODULE] = first_call_seconds(step, sync)
    steps[MODULE] = step


def module_cells(row, whole: str) -> str:
    t = row["times"]
    if MODULE not in t:
        return " - | - | - | - |"
    m = t[MODULE]
    vs_whole = f"{t[whole] / m:6.2f}x" if whole in t else "-"
    return f" {m * 1e3:9.3f} | {t['eager'] / m:6.2f}x | {t['inductor'] / m:6.2f}x | {vs_whole} |"


def module_summary(sel, whole: str) -> str:
    """"; ORTModule: {x}x over eager, ... " for the rows with an ORTModule time."""
    ran = [r for r in sel if MODULE in r["times"]]
    if not ran:
        return ""
    g = lambda key: geomean([r["times"][key] / r["times"][MODULE] for r in ran])  # noqa: E731
    with_whole = [r for r in ran if whole in r["times"]]
    text = f"; lort.ORTModule: {g('eager'):.2f}x over eager, {g('inductor'):.2f}x over inductor"
    if with_whole:
        gw = geomean([r["times"][whole] / r["times"][MODULE] for r in with_whole])
        text += f", {gw:.2f}x over whole-model ORT ({len(with_whole)} models)"
    return text


def module_where(step) -> str:
    """How ORTModule ran: direct (exported; "(eager)" where executor="auto" chose eager
    PyTorch for the graph, and the module runs itself) or through Dynamo, and why."""
    entries = list(step.module.transition_manager.entries.values())
    refused = [e.direct_refused for e in entries if e.direct_refused]
    if refused:
        return f"Dynamo ({refused[0][:60]})"
    runners = [r for e in entries for r in e.runners.values()]
    if not runners:
        return "Dynamo"
    # executor="auto" timed the exported graph against eager PyTorch on its first call,
    # and against inductor once compiled.
    if all(r.runs_eager for r in runners):
        return "direct (eager)"
    records = [r for e in entries if e.backend is not None for r in e.backend.records]
    return "direct (inductor)" if records and all(r.executor == "inductor" for r in records) else "direct"
