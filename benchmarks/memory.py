"""Peak memory of 20 training steps, eager vs inductor vs lort, on CPU.

For each model and backend, a fresh Python process builds the model (batch 8), its
inputs and an AdamW optimizer, collects garbage, reads its resident set size (VmRSS)
as the baseline and runs 20 training steps (forward, backward of
output.float().pow(2).mean(), optimizer step, zero_grad). Reported, in MiB:

- peak: the highest RSS during the 20 steps minus the baseline. The first step
  compiles, so compile-time memory counts.
- steady: the highest RSS during steps 6-20 minus the RSS just before step 6, which
  leaves compilation out.

The peak is read from VmHWM after resetting it (writing "5" to /proc/self/clear_refs);
where that reset is not allowed, a background thread samples VmRSS every 1 ms instead.
lort runs with LORT_DISK_CACHE=0 so that no cached graph changes the figure. Prints a
table and writes it with the machine line to benchmarks/results/memory.md.

    python -m benchmarks memory [--models mlp,bert] [--steps 20] [--sample] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

DEFAULT_MODELS = "mlp,cnn,transformer,bert,resnet18,gpt2,llama,mobilenetv3,vit,resnet50"
BACKENDS = ["eager", "inductor", "lort"]

CHILD = r"""
import gc, json, sys, threading, time
import torch
from lort.testing.models import CASES, output_tensor, make_torchvision_importable
make_torchvision_importable()
import lort  # imported before the baseline in every process alike

name, backend, steps, steady_from = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
force_sampling = sys.argv[5] == "1"


sys.path.insert(0, sys.argv[6])
from rss import Sampler, reset_hwm, status


model, args = CASES[name].make(8, seed=0)
model.train()
if backend == "eager":
    fn = model
elif backend == "inductor":
    fn = torch.compile(model)
else:
    fn = torch.compile(model, backend="lort")
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-4)


def step():
    out = output_tensor(fn(*args))
    out.float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


gc.collect()
use_hwm = not force_sampling and reset_hwm()
sampler = None if use_hwm else Sampler()
if sampler:
    sampler.take()
baseline = status()["VmRSS"]
t0 = time.perf_counter()
for _ in range(steady_from - 1):
    step()
t_first = time.perf_counter() - t0
peak_first = status()["VmHWM"] if use_hwm else sampler.take()
if use_hwm:
    reset_hwm()
before_steady = status()["VmRSS"]
for _ in range(steps - steady_from + 1):
    step()
peak_steady = status()["VmHWM"] if use_hwm else sampler.take()
if sampler:
    sampler.close()
print(json.dumps(dict(
    method="VmHWM" if use_hwm else "sampled VmRSS",
    baseline=baseline,
    peak=max(peak_first, peak_steady) - baseline,
    steady=peak_steady - before_steady,
    seconds_first=t_first,
    seconds=time.perf_counter() - t0,
)))
"""


def measure(name, backend, steps, steady_from, sample=False):
    env = dict(os.environ)
    if backend == "lort":
        env["LORT_DISK_CACHE"] = "0"
    out = subprocess.run(
        [sys.executable, "-c", CHILD, name, backend, str(steps), str(steady_from), "1" if sample else "0",
         os.path.dirname(os.path.abspath(__file__))],
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{name} {backend} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(b):
    return b / report.MIB


#: Ratios against less than this growth (bytes) are noise, shown as "-".
MIN_DENOMINATOR = 1 << 20


def ratio(a, b):
    return f"{a / b:.2f}" if b >= MIN_DENOMINATOR and a > 0 else "-"


HEADER = (
    "| model | eager peak MiB | inductor peak MiB | lort peak MiB | lort / eager | lort / inductor "
    "| eager steady MiB | inductor steady MiB | lort steady MiB | lort / eager steady | lort / inductor steady |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def format_row(name, r):
    e, i, l = r["eager"], r["inductor"], r["lort"]
    return (
        f"| {name} | {mib(e['peak']):.1f} | {mib(i['peak']):.1f} | {mib(l['peak']):.1f} | "
        f"{ratio(l['peak'], e['peak'])} | {ratio(l['peak'], i['peak'])} | "
        f"{mib(e['steady']):.1f} | {mib(i['steady']):.1f} | {mib(l['steady']):.1f} | "
        f"{ratio(l['steady'], e['steady'])} | {ratio(l['steady'], i['steady'])} |"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--steps", type=int, default=20, help="training steps per process")
    ap.add_argument("--steady-from", type=int, default=6, help="first step of the steady window (1-based)")
    ap.add_argument("--sample", action="store_true", help="sample VmRSS every 1 ms instead of resetting VmHWM")
    ap.add_argument("--out", default=report.result_path("memory.md"))
    a = ap.parse_args(argv)
    from lort.testing.models import CASES

    models = [m for m in a.models.split(",") if m]
    for m in models:
        if m not in CASES:
            ap.error(f"unknown model {m!r}; choose from {list(CASES)}")
    if not 1 < a.steady_from <= a.steps:
        ap.error("--steady-from must lie in 2..--steps")
    mach = report.machine()
    print(mach)
    print(HEADER, flush=True)
    rows, methods = [], set()
    t0 = time.perf_counter()
    for name in models:
        r = {b: measure(name, b, a.steps, a.steady_from, a.sample) for b in BACKENDS}
        methods.update(v["method"] for v in r.values())
        rows.append((name, r))
        print(format_row(name, r), flush=True)
    elapsed = time.perf_counter() - t0
    n, s = a.steps, a.steady_from
    lines = [
        "# Peak memory of training steps",
        "",
        f"Taken {datetime.date.today().isoformat()} by `{report.command('memory', argv)}` ({elapsed:.0f} s in all).",
        f"Machine: {mach}.",
        "",
        f"What is measured: the growth of the process's peak resident memory (RSS) over {n} training steps",
        "at batch 8 (forward, backward of `output_tensor(out).float().pow(2).mean()`, AdamW step, zero_grad),",
        "in MiB, one fresh process per figure. Each process imports torch and lort, builds the model, its",
        "inputs and the optimizer, runs `gc.collect()` and reads its RSS as the baseline; then it runs the steps.",
        "",
        f"- **peak**: highest RSS during steps 1-{n} minus the baseline. The first step compiles, so",
        "  compile-time memory (capture, translation, ORT sessions, inductor's code generation) counts,",
        "  and so do the optimizer's state and the gradients, which eager allocates too.",
        f"- **steady**: highest RSS during steps {s}-{n} minus the RSS just before step {s}: compilation",
        "  excluded, what a running training loop needs beyond what it already holds.",
        "- ratios: lort / eager and lort / inductor; below 1 means lort needs less memory (\"-\" where the",
        "  denominator grew by less than 1 MiB; the geomeans leave those rows out).",
        "",
        f"Peak read by: {', '.join(sorted(methods))} (VmHWM reset by writing 5 to /proc/self/clear_refs;",
        "sampled VmRSS = a background thread every 1 ms, used where that reset is not allowed).",
        "lort runs with LORT_DISK_CACHE=0 (no cached graphs). Memory of child processes (inductor's",
        "compile workers and C++ compiler) is not counted.",
        "",
        HEADER,
        *[format_row(name, r) for name, r in rows],
        "",
    ]
    for key in ("peak", "steady"):
        for other in ("eager", "inductor"):
            rs = [r["lort"][key] / r[other][key] for _, r in rows if r[other][key] >= MIN_DENOMINATOR and r["lort"][key] > 0]
            if rs:
                lines.append(f"- {key}: geomean lort / {other} {report.geomean(rs):.2f}")
    report.write_file(a.out, "\n".join(lines) + "\n")
    print("\n".join(l for l in lines if l.startswith("- peak:") or l.startswith("- steady:")))
    print(f"{elapsed:.0f} s; wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
