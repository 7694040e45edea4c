"""How much of lort's inference latency is Dynamo's per-call guard check (issue 13).

For each model, at batch 1 and 8 under no_grad, side by side in one process (run.py's
round-robin median): eager; lort as torch.compile builds it by default; lort with
``options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}``
(Dynamo no longer checks the modules' attributes and parameters on each call: safe only
while the model's modules do not change after compiling; lort still checks its frozen
weights); Dynamo alone, a backend that returns a precomputed output (the floor any
torch.compile backend pays, guards included); and the model exported whole to ORT
(whole_ort.py). Writes benchmarks/studies/dynamo_guards.md.

    python benchmarks/studies/dynamo_guards.py [--models mlp,mobilenetv3] [--scenarios infer1,infer8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this study's folder, then benchmarks/ (the shared modules)
from report import geomean, machine  # noqa: E402
from run import SCENARIOS, model_and_args, where_lort_ran  # noqa: E402
from timing import timed_interleaved  # noqa: E402
from whole_ort import whole_ort_step  # noqa: E402

import lort  # noqa: E402

MODELS = ["mlp", "cnn", "transformer", "bert", "resnet18", "resnet50", "mobilenetv3", "vit"]
SKIP = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
COLUMNS = ["eager", "lort", "lort, no module guards", "Dynamo alone", "whole ORT"]


def _no_grad(fn, args, backend=None):
    def step():
        with torch.no_grad():
            return fn(*args)

    step.backend = backend
    return step


def steps_for(name: str, scenario: str) -> dict:
    _, model, args = model_and_args(name, scenario)
    steps = {"eager": _no_grad(model, args)}
    backend, skip_backend = lort.LortBackend(), lort.LortBackend()
    steps["lort"] = _no_grad(torch.compile(model, backend=backend), args, backend)
    steps["lort, no module guards"] = _no_grad(torch.compile(model, backend=skip_backend, options=SKIP), args, skip_backend)
    with torch.no_grad():
        out = model(*args)

    def constant(gm, example_inputs):
        return lambda *a: out

    steps["Dynamo alone"] = _no_grad(torch.compile(model, backend=constant), args)
    _, fresh, fresh_args = model_and_args(name, scenario)  # the export may change the model it traces
    whole = whole_ort_step(fresh, fresh_args, "cpu")
    if not isinstance(whole, str):
        steps["whole ORT"] = whole
    for step in steps.values():
        step()  # compile
    return steps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--scenarios", default="infer1,infer8")
    ap.add_argument("--min-time", type=float, default=1.0)
    ap.add_argument("--out", default=os.path.join(HERE, "dynamo_guards.md"))
    a = ap.parse_args(argv)
    rows = []
    for scenario in a.scenarios.split(","):
        assert scenario in SCENARIOS and SCENARIOS[scenario][0] == "inference", scenario
        for name in a.models.split(","):
            torch._dynamo.reset()
            steps = steps_for(name, scenario)
            times = timed_interleaved(steps, min_time=a.min_time)
            times["ran in"] = where_lort_ran(steps["lort"])
            rows.append((name, scenario, times))
            print(name, scenario, {k: v if isinstance(v, str) else round(v * 1e3, 3) for k, v in times.items()}, flush=True)
    head = "| model | run | " + " | ".join(f"{c} ms" for c in COLUMNS)
    lines = [
        "# Dynamo's per-call guards and lort's inference latency",
        "",
        f"Taken {time.strftime('%Y-%m-%d')} by `python benchmarks/studies/dynamo_guards.py`. {machine()}",
        "",
        "Median of 11 round-robin samples per column, in ms, under no_grad. *lort, no module guards*:",
        "`torch.compile(model, backend=lort.LortBackend(), options={\"guard_filter_fn\":",
        "torch.compiler.skip_guard_on_all_nn_modules_unsafe})`. *Dynamo alone*: a backend returning a",
        "precomputed output, what Dynamo costs any backend per call. *lort's own*: lort minus Dynamo",
        "alone. Ratios are whole ORT time / lort time (above 0.85 meets issue 13's bar).",
        "",
        head + " | lort's own ms | lort vs whole ORT | no module guards vs whole ORT | lort ran in |",
        "|---|---|" + "---:|" * (len(COLUMNS) + 3) + "---|",
    ]
    ratios = {"lort": [], "skip": []}
    for name, scenario, t in rows:
        cells = [f"{t[c] * 1e3:.3f}" if c in t else "export fails" for c in COLUMNS]
        own = f"{(t['lort'] - t['Dynamo alone']) * 1e3:.3f}"
        if "whole ORT" in t:
            r1, r2 = t["whole ORT"] / t["lort"], t["whole ORT"] / t["lort, no module guards"]
            ratios["lort"].append(r1)
            ratios["skip"].append(r2)
            tail = f"{r1:.2f}x | {r2:.2f}x"
        else:
            tail = "- | -"
        lines.append(f"| {name} | {scenario} | " + " | ".join(cells) + f" | {own} | {tail} | {t['ran in']} |")
    if ratios["lort"]:
        lines += ["", f"Geomean over the rows with a whole-ORT time: lort {geomean(ratios['lort']):.2f}x, "
                  f"lort without module guards {geomean(ratios['skip']):.2f}x of whole-model ORT's speed."]
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
