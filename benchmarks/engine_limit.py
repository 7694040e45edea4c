"""lort against the engine's limit: each model exported whole to ORT, with the same ORT
settings on both sides, spinning off (lort's default) and on, side by side in one process.

For each model and batch (inference under no_grad): eager; the whole model in one ORT
session (benchmarks/whole_ort.py) with intra-op spinning off and on; ``lort.ORTModule``
and ``torch.compile(backend=lort.LortBackend(...))`` with ``allow_spinning`` off and on;
and, for the per-call cost of each front end, the frozen ORT session lort built for the
model called directly on the input (one group with one input: "session alone"). Each
front end's own cost per call is its time minus its session's alone (guards, the weight
check, binding, output wrapping; for torch.compile, Dynamo's frame and guards).

Times are medians of 15 round-robin samples with a 20 ms pause after each (spinning
threads of one step must not slow the next). Ratios are whole-ORT time / lort time at
the same spinning setting (at least 0.9 for ORTModule and 0.8 for torch.compile is issue
31's bar) and eager time / lort time.

    python -m benchmarks engine-limit [--models efficientnet,convnext] [--batches 1,8] [--out FILE]

Writes benchmarks/results/engine_limit_run.md (``--out``), not results/engine_limit.md: that
file holds the runs' tables with their commands and the reading written by hand, into which
a new run's table is copied when it is read.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys

import torch

from lort.testing.models import CASES, make_torchvision_importable

make_torchvision_importable()

import lort  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402
from timing import timed_interleaved  # noqa: E402
from whole_ort import whole_ort_step  # noqa: E402

DEFAULT_MODELS = ["efficientnet", "convnext", "mobilevit", "levit", "regnety", "mobilenetv3", "vit", "resnet50"]
COLUMNS = ["eager", "whole", "whole_spin", "ortmodule", "ortmodule_spin", "compile", "compile_spin",
           "compile_filtered", "om_session", "tc_session", "tc_graph"]


def _last_graph(records):
    """The record of the last graph compiled with ORT groups (the one every call runs,
    where a first call changed what the next compile saw: timm LeViT fills a cache), or
    None."""
    records = [r for r in records if r.group_modules]
    return records[-1] if records else None


def _frozen_session(records):
    """The frozen ORT session of the last graph compiled, when it is one group, or None."""
    last = _last_graph(records)
    groups = list(last.group_modules.values()) if last else []
    if len(groups) != 1 or len(groups[0]._frozen_sessions) != 1 or len(groups[0]._live) != 1:
        return None
    return next(iter(groups[0]._frozen_sessions.values()))


def _graph_call(records, run):
    """A call of lort's compiled graph (what AOTAutograd calls) with the arguments
    Dynamo passes it, found by running ``run`` once; None where the last graph is not one
    group."""
    last = _last_graph(records)
    if last is None or last.partitioned is None or len(last.group_modules) != 1:
        return None
    part, (group,) = last.partitioned, last.group_modules.values()
    placeholders = [n for n in part.graph.nodes if n.op == "placeholder"]
    calls = [n for n in part.graph.nodes if n.op == "call_module"]
    if len(calls) != 1 or not all(a in placeholders for a in calls[0].args):
        return None  # PyTorch work before the group
    seen, forward = {}, group.forward
    group.forward = lambda *a: seen.setdefault("args", a) and forward(*a)
    try:
        run()
    finally:
        del group.forward
    flat = [None] * len(placeholders)
    for node, value in zip(calls[0].args, seen["args"]):
        flat[placeholders.index(node)] = value
    return lambda: part.forward(*flat)


def steps_for(name: str, batch: int) -> tuple[dict, dict]:
    """The steps of one row, and why a column is missing."""
    model, args = CASES[name].make(batch, seed=0)
    model.eval()
    steps, missing = {}, {}

    def eager():
        with torch.no_grad():
            return model(*args)

    steps["eager"] = eager
    for spin in (False, True):
        whole = whole_ort_step(copy.deepcopy(model), args, spinning=spin)
        key = "whole_spin" if spin else "whole"
        if callable(whole):
            steps[key] = whole
        else:
            missing[key] = whole
        opts = lort.Options(allow_spinning=spin)
        om = lort.ORTModule(copy.deepcopy(model), options=opts)
        backend = lort.LortBackend(opts)
        compiled = torch.compile(copy.deepcopy(model), backend=backend)

        def om_step(om=om):
            with torch.no_grad():
                return om(*args)

        def tc_step(compiled=compiled):
            with torch.no_grad():
                return compiled(*args)

        om_step(), om_step(), tc_step(), tc_step()
        steps["ortmodule_spin" if spin else "ortmodule"] = om_step
        steps["compile_spin" if spin else "compile"] = tc_step
        if not spin:
            x = args[0].contiguous()
            for key, records in (("om_session", om.transition_manager.records), ("tc_session", backend.records)):
                sess = _frozen_session(records)
                if sess is None:
                    missing[key] = "not one frozen group"
                else:
                    steps[key] = lambda sess=sess: sess.run([x])
            graph = _graph_call(backend.records, tc_step)
            if graph is None:
                missing["tc_graph"] = "not one group taking the graph's inputs"
            else:
                steps["tc_graph"] = graph
            # What Dynamo's guards on the modules cost: skipped, as a user may choose to.
            filtered = torch.compile(copy.deepcopy(model), backend=lort.LortBackend(opts),
                                     options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})

            def filtered_step(filtered=filtered):
                with torch.no_grad():
                    return filtered(*args)

            filtered_step(), filtered_step()
            steps["compile_filtered"] = filtered_step
    return steps, missing


def _ratio(t: dict, num: str, den: str) -> str:
    return f"{t[num] / t[den]:.2f}x" if num in t and den in t else "-"


def _ms(t: dict, key: str) -> str:
    return f"{t[key] * 1e3:.3f}" if key in t else "-"


def format_rows(rows: list) -> list[str]:
    lines = [
        "| model | batch | eager ms | whole ORT ms | ORTModule ms | torch.compile ms | ORTModule vs whole | "
        "torch.compile vs whole | whole ORT spin ms | ORTModule spin ms | torch.compile spin ms | "
        "ORTModule vs whole, spin | torch.compile vs whole, spin | ORTModule vs eager | torch.compile vs eager | "
        "ORTModule's own ms | torch.compile's own ms | of which Dynamo's ms | of which lort's graph ms | "
        "torch.compile, no module guards ms | no module guards vs whole |",
        "|---|---:|" + "---:|" * 19,
    ]
    for name, batch, t, _ in rows:
        own_om = f"{(t['ortmodule'] - t['om_session']) * 1e3:.3f}" if "om_session" in t else "-"
        own_tc = f"{(t['compile'] - t['tc_session']) * 1e3:.3f}" if "tc_session" in t else "-"
        dynamo = f"{(t['compile'] - t['tc_graph']) * 1e3:.3f}" if "tc_graph" in t else "-"
        graph = f"{(t['tc_graph'] - t['tc_session']) * 1e3:.3f}" if "tc_graph" in t and "tc_session" in t else "-"
        lines.append(
            f"| {name} | {batch} | {_ms(t, 'eager')} | {_ms(t, 'whole')} | {_ms(t, 'ortmodule')} | {_ms(t, 'compile')} | "
            f"{_ratio(t, 'whole', 'ortmodule')} | {_ratio(t, 'whole', 'compile')} | {_ms(t, 'whole_spin')} | "
            f"{_ms(t, 'ortmodule_spin')} | {_ms(t, 'compile_spin')} | {_ratio(t, 'whole_spin', 'ortmodule_spin')} | "
            f"{_ratio(t, 'whole_spin', 'compile_spin')} | {_ratio(t, 'eager', 'ortmodule')} | {_ratio(t, 'eager', 'compile')} | "
            f"{own_om} | {own_tc} | {dynamo} | {graph} | {_ms(t, 'compile_filtered')} | "
            f"{_ratio(t, 'whole', 'compile_filtered')} |"
        )
    for key, label in (("ortmodule", "ORTModule"), ("compile", "torch.compile"),
                       ("compile_filtered", "torch.compile without module guards")):
        for spin in ("", "_spin"):
            pairs = [t["whole" + spin] / t[key + spin] for _, _, t, _ in rows if "whole" + spin in t and key + spin in t]
            if pairs:
                lines.append(f"\n- {label} vs whole ORT{', spinning' if spin else ''}: geomean "
                             f"{statistics.geometric_mean(pairs):.2f}x, {min(pairs):.2f}x to {max(pairs):.2f}x")
    slower = [f"{n} batch {b} ({label} {t['eager'] / t[k]:.2f}x)" for n, b, t, _ in rows
              for k, label in (("ortmodule", "ORTModule"), ("compile", "torch.compile")) if k in t and t[k] > t["eager"]]
    lines.append(f"- slower than eager: {', '.join(slower) if slower else 'none'}")
    for n, b, _, missing in rows:
        for key, why in missing.items():
            lines.append(f"- {n} batch {b}, {key}: {why}")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--min-time", type=float, default=3.0, help="seconds per step per row")
    ap.add_argument("--out", default=report.result_path("engine_limit_run.md"))
    a = ap.parse_args(argv)
    rows = []
    for name in a.models.split(","):
        for batch in (int(b) for b in a.batches.split(",")):
            steps, missing = steps_for(name, batch)
            with torch.no_grad():
                t = timed_interleaved(steps, a.min_time * len(steps) / 4, repeats=15, settle_s=0.02)
            rows.append((name, batch, t, missing))
            print(format_rows(rows[-1:])[2], flush=True)
            del steps
    head = [f"Taken {datetime.date.today()} by `{report.command('engine-limit', argv)}`; {report.machine()}.", ""]
    report.write_file(a.out, "\n".join(head + format_rows(rows)) + "\n")
    print("\n".join(format_rows(rows)))


if __name__ == "__main__":
    main()
