"""Peak GPU memory of training steps, lort against eager (and inductor on request), on CUDA.

For each model of lort.testing.models.CUDA_CASES and each backend, a fresh Python process
builds the model on the GPU (training mode, batch 32 unless --batch says otherwise), its
inputs and an AdamW optimizer, synchronizes, collects garbage and reads the device's used
memory as the baseline; then it runs the training steps (forward, backward of
output.float().pow(2).mean(), optimizer step, zero_grad), synchronizing after each.

The device's used memory is read with NVML (``pynvml``, from nvidia-ml-py) where it
answers, else with ``torch.cuda.mem_get_info``: both see every allocation on the device,
ORT's own arena and workspaces included, which ``torch.cuda.max_memory_allocated`` does
not. A background thread samples it every millisecond. The device must be otherwise
idle (one process at a time here). Reported, in MiB:

- peak: the highest used memory during all the steps minus the baseline; the first step
  compiles, so compile-time memory (ORT sessions, their arenas, cuBLAS/cuDNN workspaces
  and handles, inductor's autotuning) counts, and so do the optimizer's state and the
  gradients, which eager allocates too.
- steady: the highest used memory during steps --steady-from.. minus the used memory just
  before them: what the running loop needs beyond what it already holds.
- torch peak: PyTorch's caching allocator's own peak (max_memory_reserved) over the
  steps minus its baseline; peak minus torch peak is memory outside PyTorch's allocator
  (ORT's arenas, the libraries' workspaces).

    python -m benchmarks cuda-memory [--models bert,resnet50] [--backends eager,lort,inductor]
        [--steps 10] [--lort-options '{"executor": "ort"}'] [--json rows.json] [--out FILE]

``--lort-options`` passes options to lort (to show the effect of one, e.g. on ORT's
arena); rows are kept per model and options, so runs with different options sit side by
side in the table. ``--json`` keeps rows across runs on the same device.
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
import cuda_common  # noqa: E402
import report  # noqa: E402

CHILD = r"""
import gc, json, sys, threading, time
import torch
from lort.testing.models import CUDA_CASES, output_tensor, make_torchvision_importable
make_torchvision_importable()
import lort  # imported before the baseline in every process alike

name, backend, batch, steps, steady_from, options = (
    sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), json.loads(sys.argv[6]))
dev = torch.cuda.current_device()

def nvml_reader():
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(dev)
        read = lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        read()
        return read
    except Exception:
        return None

def mem_get_info():
    free, total = torch.cuda.mem_get_info(dev)
    return total - free

read = nvml_reader() or mem_get_info
method = "NVML" if read is not mem_get_info else "torch.cuda.mem_get_info"


class Sampler:
    def __init__(self):
        self.peak = read()
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop:
            self.peak = max(self.peak, read())
            time.sleep(0.001)

    def take(self):
        # The peak since the last take (and the current reading).
        now = read()
        peak, self.peak = max(self.peak, now), now
        return peak

    def close(self):
        self.stop = True
        self.thread.join()


model, args = CUDA_CASES[name].make(batch, seed=0)
model = model.to("cuda").train()
args = tuple(a.to("cuda") for a in args)
if backend == "eager":
    fn = model
elif backend == "inductor":
    fn = torch.compile(model)
else:
    fn = torch.compile(model, backend="lort", options=options or None)
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-4)


def step():
    out = output_tensor(fn(*args))
    out.float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    torch.cuda.synchronize()


torch.cuda.synchronize()
gc.collect()
torch.cuda.reset_peak_memory_stats()
torch_base = torch.cuda.memory_reserved()
baseline = read()
sampler = Sampler()
sampler.take()
t0 = time.perf_counter()
for _ in range(steady_from - 1):
    step()
t_first = time.perf_counter() - t0
peak_first = sampler.take()
before_steady = read()
for _ in range(steps - steady_from + 1):
    step()
peak_steady = sampler.take()
sampler.close()
print(json.dumps(dict(
    method=method,
    baseline=baseline,
    peak=max(peak_first, peak_steady) - baseline,
    steady=peak_steady - before_steady,
    torch_peak=torch.cuda.max_memory_reserved() - torch_base,
    seconds_first=t_first,
    seconds=time.perf_counter() - t0,
)))
"""


def measure(name, backend, batch, steps, steady_from, options, timeout):
    env = dict(os.environ)
    if backend == "lort":
        env["LORT_DISK_CACHE"] = "0"
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, name, backend, str(batch), str(steps), str(steady_from), json.dumps(options)],
            env=env, capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if out.returncode != 0:
        lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
        print(f"{name} {backend} failed:\n{out.stderr[-3000:]}", flush=True)
        return {"error": (lines[-1] if lines else f"exit status {out.returncode}")[:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(b):
    return b / report.MIB


def cell(r, key):
    return f"{mib(r[key]):.0f}" if "error" not in r else "failed"


def ratio(r, e, key):
    if "error" in r or "error" in e or e[key] < (1 << 20):
        return "-"
    return f"{r[key] / e[key]:.2f}"


def format_row(row, backends):
    res = row["results"]
    e = res.get("eager", {"error": "not run"})
    cells = [row["model"], row["options"] or "defaults"]
    for key in ("peak", "steady"):
        for b in backends:
            r = res.get(b, {"error": "not run"})
            cells.append(cell(r, key) + (f" ({ratio(r, e, key)})" if b != "eager" else ""))
    for b in backends:
        r = res.get(b, {"error": "not run"})
        cells.append(cell(r, "torch_peak"))
    errors = [f"{b}: {r['error']}" for b, r in res.items() if "error" in r]
    cells.append("; ".join(errors) or "")
    return "| " + " | ".join(cells) + " |"


def header(backends):
    cols = ["model", "lort options"]
    cols += [f"{b} peak MiB" for b in backends] + [f"{b} steady MiB" for b in backends]
    cols += [f"{b} torch peak MiB" for b in backends] + ["errors"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * 2 + "---:|" * (3 * len(backends)) + "---|"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help="default: every model of lort.testing.models.CUDA_CASES")
    ap.add_argument("--backends", default="eager,lort", help="of eager, lort, inductor (eager always runs)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10, help="training steps per process")
    ap.add_argument("--steady-from", type=int, default=4, help="first step of the steady window (1-based)")
    ap.add_argument("--lort-options", default="{}", help="lort options as JSON, for the lort runs")
    ap.add_argument("--timeout", type=int, default=400, help="seconds per process")
    ap.add_argument("--json", default=None, help="keep rows in this file and merge earlier runs' rows")
    ap.add_argument("--out", default=report.result_path("cuda_memory.md"))
    a = ap.parse_args(argv)
    why = cuda_common.cuda_unavailable()
    if why:
        ap.error(why.replace("--device cuda", "python -m benchmarks cuda-memory"))
    from lort.testing.models import CUDA_CASES

    models = [m for m in (a.models or ",".join(CUDA_CASES)).split(",") if m]
    for m in models:
        if m not in CUDA_CASES:
            ap.error(f"unknown model {m!r}; choose from {list(CUDA_CASES)}")
    backends = ["eager"] + [b for b in a.backends.split(",") if b and b != "eager"]
    for b in backends:
        if b not in ("eager", "lort", "inductor"):
            ap.error(f"unknown backend {b!r}; choose from eager, lort, inductor")
    if not 1 < a.steady_from <= a.steps:
        ap.error("--steady-from must lie in 2..--steps")
    try:
        options = json.loads(a.lort_options)
        assert isinstance(options, dict)
    except (ValueError, AssertionError):
        ap.error(f"--lort-options must be a JSON object, not {a.lort_options!r}")
    options_label = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
    mach = cuda_common.machine()
    rows = cuda_common.Rows(a.json, cuda_common.device_name(), key=("model", "options", "batch", "steps"))
    print(mach)
    print(header(backends), flush=True)
    t0 = time.perf_counter()
    for name in models:
        res = {b: measure(name, b, a.batch, a.steps, a.steady_from, options, a.timeout) for b in backends}
        row = dict(model=name, options=options_label, batch=a.batch, steps=a.steps, results=res)
        rows.add(row)
        print(format_row(row, backends), flush=True)
        write(a, rows, backends, mach, time.perf_counter() - t0)
    print(f"{time.perf_counter() - t0:.0f} s; wrote {a.out}" + (f" and {a.json}" if a.json else ""))


def write(a, rows, backends, mach, elapsed):
    all_rows = rows.all()
    shown = sorted({b for r in all_rows for b in r["results"]}, key=["eager", "lort", "inductor"].index)
    methods = sorted({r.get("method") for row in all_rows for r in row["results"].values() if "method" in r})
    lines = [
        "# Peak GPU memory of training steps",
        "",
        f"Taken {datetime.date.today().isoformat()} by `python -m benchmarks cuda-memory`"
        + (f" ({rows.runs} runs on this device merged with --json)." if rows.runs > 1 else f" ({elapsed:.0f} s)."),
        f"Device: {mach}.",
        f"Numerics: float32; {cuda_common.tf32_line()}.",
        "",
        f"What is measured: the growth of the device's used memory over {a.steps} training steps at batch",
        f"{a.batch} (forward, backward of `output_tensor(out).float().pow(2).mean()`, AdamW step, zero_grad,",
        "synchronize), in MiB, one fresh process per figure, read by "
        + (", ".join(methods) or "NVML or torch.cuda.mem_get_info") + " every millisecond from a thread.",
        "Each process builds the model, its inputs and the optimizer on the GPU, synchronizes, collects",
        "garbage and reads the used memory as the baseline.",
        "",
        "- **peak**: highest used memory during all the steps minus the baseline; the first step compiles,",
        "  so compile-time memory counts (ORT sessions and arenas, library workspaces, inductor's autotuning).",
        f"- **steady**: highest used memory from step {a.steady_from} on, minus the used memory just before it.",
        "- in parentheses: the ratio to eager's figure (below 1: less memory than eager).",
        "- **torch peak**: the growth of PyTorch's caching allocator's reserved memory (max_memory_reserved);",
        "  peak minus torch peak is memory outside PyTorch's allocator (ORT's arenas, workspaces).",
        "lort runs with LORT_DISK_CACHE=0 and the options in the row (defaults: executor='auto').",
        "",
        header(shown),
        *[format_row(r, shown) for r in all_rows],
        "",
    ]
    report.write_file(a.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
