"""eager vs inductor vs lort, side by side in one process, on CPU.

For each model: batch-1 inference latency, batch-8 inference latency and a training
step (forward + backward), the median of repeated timings, and the first call (capture
+ compile). Prints a ratio table (speed-up over eager: eager time / time) and writes it
with the machine and versions to benchmarks/results.md.

    python benchmarks/run.py [--models bert,resnet18] [--scenarios infer1,infer8,train] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import sys
import time

import torch

from lort.testing.models import CASES, make_torchvision_importable, output_tensor

make_torchvision_importable()

import onnxruntime  # noqa: E402
import onnxscript  # noqa: E402

import lort  # noqa: E402

SCENARIOS = {"infer1": ("inference", 1), "infer8": ("inference", 8), "train": ("train", 8)}
BACKENDS = ["eager", "inductor", "lort"]


def timed_interleaved(fns: dict, min_time=1.0, repeats=11, settle_s=0.0) -> dict:
    """Median seconds per call of each function, sampled round-robin (A B C A B C ...)
    so that drift in the machine's speed affects every backend alike. Each sample is the
    mean over enough calls to last about min_time / repeats. ``settle_s``: a pause after
    each sample, untimed, so that threads still spinning after one function (ORT with
    allow_spinning) do not slow the next."""
    inner = {}
    for name, fn in fns.items():
        for _ in range(3):
            fn()
        t0 = time.perf_counter()
        fn()
        one = max(time.perf_counter() - t0, 1e-6)
        inner[name] = max(1, int(min_time / repeats / one))
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            n = inner[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n)
            if settle_s:
                time.sleep(settle_s)
    return {name: statistics.median(v) for name, v in samples.items()}


def make_runner(name, scenario, backend):
    kind, batch = SCENARIOS[scenario]
    model, args = CASES[name].make(batch, seed=0)
    model = copy.deepcopy(model)
    if kind == "inference":
        model.eval()
    if backend == "eager":
        fn = model
    elif backend == "inductor":
        fn = torch.compile(model)
    else:
        fn_backend = lort.LortBackend()
        fn = torch.compile(model, backend=fn_backend)
    if kind == "inference":
        def step():
            with torch.no_grad():
                return fn(*args)
    else:
        params = [p for p in model.parameters() if p.requires_grad]

        def step():
            for p in params:
                p.grad = None
            out = output_tensor(fn(*args))
            out.float().pow(2).mean().backward()
    if backend == "lort":
        step.backend = fn_backend
    return step


def run(models, scenarios, min_time):
    rows = []
    for name in models:
        for scenario in scenarios:
            torch._dynamo.reset()
            steps, firsts = {}, {}
            # lort's first call times its graph against eager (executor="auto"): it is
            # made before inductor's, whose compile workers may still be busy after it.
            for backend in ("eager", "lort", "inductor"):
                step = make_runner(name, scenario, backend)
                t0 = time.perf_counter()
                step()
                firsts[backend] = time.perf_counter() - t0
                steps[backend] = step
            times = timed_interleaved(steps, min_time * len(BACKENDS))
            row = dict(model=name, scenario=scenario, times=times, firsts=firsts, where=where_lort_ran(steps["lort"]))
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def where_lort_ran(step) -> str:
    """Where lort ran the model: ORT (with how many of its groups executor='auto' moved
    to PyTorch), or eager PyTorch for graphs it timed faster there."""
    records = step.backend.records
    eager = sum(r.executor == "pytorch" for r in records)
    if records and eager == len(records):
        return "eager"
    groups = [g for r in records if r.executor != "pytorch" for g in r.groups]
    moved = sum(g.executor == "pytorch" for g in groups)
    where = "ORT" if not moved else f"ORT, {moved}/{len(groups)} groups PyTorch"
    return where if not eager else f"{where}; {eager}/{len(records)} graphs eager"


def format_row(row):
    t = row["times"]
    return (
        f"| {row['model']:<12} | {row['scenario']:<7} | {t['eager'] * 1e3:9.3f} | {t['inductor'] * 1e3:9.3f} | "
        f"{t['lort'] * 1e3:9.3f} | {t['eager'] / t['lort']:6.2f}x | {t['inductor'] / t['lort']:6.2f}x | "
        f"{row['firsts']['inductor']:7.1f} | {row['firsts']['lort']:7.1f} | {row['where']} |"
    )


HEADER = (
    "| model        | run     |  eager ms | inductor ms |  lort ms | lort vs eager | lort vs inductor | inductor 1st call s | lort 1st call s | lort ran in |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"
)


def geomean(xs):
    return statistics.geometric_mean(xs) if xs else float("nan")


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; "
        f"Python {platform.python_version()}, torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, "
        f"onnxscript {onnxscript.__version__}, lort {lort.__version__}"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(CASES))
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds of timed calls per measurement")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results.md"))
    a = ap.parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    scenarios = [s for s in a.scenarios.split(",") if s]
    for m in models:
        if m not in CASES:
            ap.error(f"unknown model {m!r}; choose from {list(CASES)}")
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}; choose from {list(SCENARIOS)}")
    print(machine())
    print(HEADER)
    rows = run(models, scenarios, a.min_time)
    lines = [
        "# lort benchmark results",
        "",
        f"Taken {datetime.date.today().isoformat()} by `python benchmarks/run.py` (all backends side by side in one process).",
        f"Machine: {machine()}.",
        "",
        "Times are the median of 11 samples per backend, taken round-robin across the backends",
        "(each sample a mean over repeated calls); ratios are speed-ups",
        "(eager time / lort time, inductor time / lort time): above 1 means lort is faster.",
        "infer1/infer8: inference under no_grad at batch 1 / 8; train: forward + backward at batch 8.",
        "First call: capture + compile + first run, in seconds, in this process, each backend with its on-disk",
        "cache as this machine had it (inductor's is often warm from earlier runs); benchmarks/first_call.py",
        "compares cold and warm first calls in fresh processes.",
        "",
        HEADER,
        *[format_row(r) for r in rows],
        "",
    ]
    for s in scenarios:
        sel = [r for r in rows if r["scenario"] == s]
        if sel:
            ge = geomean([r["times"]["eager"] / r["times"]["lort"] for r in sel])
            gi = geomean([r["times"]["inductor"] / r["times"]["lort"] for r in sel])
            lines.append(f"- {s}: geomean lort speed-up {ge:.2f}x over eager, {gi:.2f}x over inductor")
    text = "\n".join(lines) + "\n"
    with open(a.out, "w") as f:
        f.write(text)
    print("\n".join(lines[-len(scenarios):]))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
