"""Resident memory of inference with frozen weights (issue 13): eager vs lort frozen vs
lort unfrozen vs the model exported whole to ORT, on CPU.

Each model and variant runs in a fresh Python process, so that each peak is its own.
Every process imports alike (torch, lort, onnxruntime, onnx, onnx_ir, onnxscript,
torch.onnx, torch._dynamo and benchmarks/whole_ort.py) before anything is measured, then:

1. reads VmRSS (``rss_empty``), builds the model at batch 1 (``CASES[name].make(1,
   seed=0)``, eval mode) and its inputs, runs ``gc.collect()`` and reads VmRSS again:
   the **baseline** (the process with the model's own weights);
2. resets the high-water mark (writes "5" to /proc/self/clear_refs; where that is not
   allowed, a thread samples VmRSS every 1 ms) and, under ``torch.no_grad()``, builds the
   variant and makes 20 calls on the same inputs. Peak = VmHWM after them: compilation
   (lort's first call; the whole-model export, session build and its check against
   eager) counts. The peak of the first call (with the build) and of calls 2-20 are also
   kept apart;
3. after the calls, ``gc.collect()``: **steady** = VmRSS; **kept** = VmRSS after glibc's
   ``malloc_trim(0)`` too (freed heap handed back), what the process really holds.

Variants: ``eager`` (the module), ``frozen`` (``torch.compile(model, backend="lort",
options={"freeze": "auto", "disk_cache": False, "progress": False})``), ``unfrozen``
(the same with ``"freeze": False``), ``whole`` (``whole_ort.whole_ort_step(model, args,
"cpu")``: the step made 20 times; or the reason it could not run). Weights: the bytes of
the state dict, each storage counted once. Prints the table and writes it with the
machine line to benchmarks/results/frozen_memory.md.

    python -m benchmarks frozen-memory [--models mlp,resnet18] [--calls 20] [--out FILE] [--json FILE]

``--sizes cuda`` takes the models at issue 10's sizes (lort.testing.models.CUDA_CASES:
BERT and GPT-2 6x768, Llama 4x1024, ResNet-50 and ViT-S/16 at 224 px), still on CPU,
where the weights outweigh the libraries' fixed cost; it writes
benchmarks/results/frozen_memory_large.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

DEFAULT_MODELS = "mlp,cnn,bert,resnet18,resnet50,mobilenetv3,vit,gpt2,llama"
VARIANTS = ["eager", "frozen", "unfrozen", "whole"]
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402

CHILD = r"""
import ctypes, gc, json, sys, threading, time
import torch
from lort.testing.models import CASES, make_torchvision_importable
make_torchvision_importable()
import lort, onnx, onnx_ir, onnxruntime, onnxscript, torch.onnx, torch._dynamo  # alike in every process
sys.path.insert(0, sys.argv[4])
from whole_ort import whole_ort_step

name, variant, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
if sys.argv[5] == "cuda":  # issue 10's sizes (still run on CPU)
    from lort.testing.models import CUDA_CASES as CASES


from rss import Sampler, reset_hwm, status, trim


gc.collect()
rss_empty = status()["VmRSS"]
model, args = CASES[name].make(1, seed=0)
model.eval()
seen, weights = set(), 0
for t in model.state_dict().values():
    key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    if key not in seen:
        seen.add(key)
        weights += t.untyped_storage().nbytes()
gc.collect()
use_hwm = reset_hwm()
sampler = None if use_hwm else Sampler()
peak_of = (lambda: status()["VmHWM"]) if use_hwm else (lambda: sampler.take())
if sampler:
    sampler.take()
baseline = status()["VmRSS"]
why = None
t0 = time.perf_counter()
with torch.no_grad():
    if variant == "eager":
        fn = lambda: model(*args)
    elif variant in ("frozen", "unfrozen"):
        opts = {"freeze": "auto" if variant == "frozen" else False, "disk_cache": False, "progress": False}
        compiled = torch.compile(model, backend="lort", options=opts)
        fn = lambda: compiled(*args)
    else:
        fn = whole_ort_step(model, args, "cpu")
        if isinstance(fn, str):
            why, fn = fn, None
    if fn is not None:
        out = fn()
        del out
t_first = time.perf_counter() - t0
peak_first = peak_of()
if use_hwm:
    reset_hwm()
with torch.no_grad():
    for _ in range(calls - 1 if fn is not None else 0):
        out = fn()
        del out
peak_calls = peak_of()
gc.collect()
steady = status()["VmRSS"]
trim()
kept = status()["VmRSS"]
if sampler:
    sampler.stop = True
print(json.dumps(dict(
    method="VmHWM" if use_hwm else "sampled VmRSS", rss_empty=rss_empty, baseline=baseline, weights=weights,
    peak=max(peak_first, peak_calls), peak_first=peak_first, peak_calls=peak_calls, steady=steady, kept=kept,
    why=why, seconds_first=t_first, seconds=time.perf_counter() - t0,
)))
"""


def measure(name: str, variant: str, calls: int, sizes: str = "cpu") -> dict:
    env = dict(os.environ, LORT_DISK_CACHE="0")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, name, variant, str(calls), HERE, sizes], env=env, capture_output=True, text=True,
    )
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1][:200] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(b) -> str:
    return f"{b / 2**20:.1f}"


def weight_mib(b) -> str:
    return f"{b / 2**20:.2f}" if b < 10 * 2**20 else mib(b)


#: Growths below this (bytes) make ratios noise, shown as "-".
MIN_DENOMINATOR = 1 << 20


def ratio(a, b) -> str:
    return f"{a / b:.2f}" if b >= MIN_DENOMINATOR and a > 0 else "-"


def ok(r: dict) -> bool:
    return "error" not in r and r.get("why") is None


def growth(r: dict, key: str = "peak") -> int:
    return r[key] - r["baseline"]


def peak_cell(r: dict) -> str:
    if ok(r):
        return mib(r["peak"])
    return (r.get("why") or r.get("error", "?")).split(":")[0]


HEADER = (
    "| model | weights | baseline | eager peak | lort-frozen peak | lort-unfrozen peak | whole-ORT peak "
    "| frozen / unfrozen (peak - baseline) | frozen / whole-ORT (peak - baseline) |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)
COPIES_HEADER = (
    "| model | weights MiB | eager peak | frozen peak | unfrozen peak | whole-ORT peak "
    "| frozen kept | unfrozen kept | whole-ORT kept | frozen first / calls 2-N | unfrozen first / calls 2-N |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def format_row(name: str, r: dict) -> str:
    e, f, u, w = (r[v] for v in VARIANTS)
    base = e if ok(e) else f
    fu = ratio(growth(f), growth(u)) if ok(f) and ok(u) else "-"
    fw = ratio(growth(f), growth(w)) if ok(f) and ok(w) else "-"
    return (
        f"| {name} | {weight_mib(base['weights'])} | {mib(base['baseline'])} | {peak_cell(e)} | {peak_cell(f)} | "
        f"{peak_cell(u)} | {peak_cell(w)} | {fu} | {fw} |"
    )


def copies(r: dict, key: str) -> str:
    """(RSS[key] - baseline) in units of the model's weights ("-" under 1 MiB of
    weights, where the libraries' fixed cost is all one sees)."""
    return f"{growth(r, key) / r['weights']:.2f}" if ok(r) and r["weights"] >= MIN_DENOMINATOR else "-"


def first_vs_calls(r: dict) -> str:
    if not ok(r):
        return "-"
    return f"{(r['peak_first'] - r['baseline']) / 2**20:.1f} / {(r['peak_calls'] - r['baseline']) / 2**20:.1f}"


def format_copies(name: str, r: dict) -> str:
    e, f, u, w = (r[v] for v in VARIANTS)
    weights = next(x["weights"] for x in (e, f, u, w) if "weights" in x)
    return (
        f"| {name} | {weight_mib(weights)} | {copies(e, 'peak')} | {copies(f, 'peak')} | {copies(u, 'peak')} | "
        f"{copies(w, 'peak')} | {copies(f, 'kept')} | {copies(u, 'kept')} | {copies(w, 'kept')} | "
        f"{first_vs_calls(f)} | {first_vs_calls(u)} |"
    )


def notes(rows) -> list[str]:
    out = []
    for name, r in rows:
        for v in VARIANTS:
            if not ok(r[v]):
                out.append(f"- {name}, {v}: {r[v].get('why') or r[v].get('error')}")
    return out


def geomeans(rows) -> list[str]:
    out = []
    for a, b in (("frozen", "unfrozen"), ("frozen", "whole"), ("frozen", "eager"), ("unfrozen", "eager")):
        rs = [growth(r[a]) / growth(r[b]) for _, r in rows
              if ok(r[a]) and ok(r[b]) and growth(r[b]) >= MIN_DENOMINATOR and growth(r[a]) > 0]
        if rs:
            out.append(f"- geomean (peak - baseline) {a} / {b}: {report.geomean(rs):.2f} ({len(rs)} models)")
    return out


def render(rows, mach, calls, elapsed, methods, sizes="cpu") -> str:
    lines = [
        "# Resident memory of inference with frozen weights (issue 13)",
        "",
        f"Taken {datetime.date.today().isoformat()} by `python -m benchmarks frozen-memory"
        f"{' --sizes cuda' if sizes == 'cuda' else ''}` ({elapsed:.0f} s in all,",
        "one process at a time).",
        f"Machine: {mach}.",
        "",
        "Each figure comes from a fresh Python process (one per model and variant), which imports torch, lort,",
        "onnxruntime, onnx, onnx_ir, onnxscript, torch.onnx, torch._dynamo and benchmarks/whole_ort.py, builds",
        f"the model at batch 1 (lort.testing.models.{'CUDA_CASES, run on CPU' if sizes == 'cuda' else 'CASES'}, seed 0,"
        " eval mode) and its inputs, runs gc.collect()",
        "and reads its RSS: the **baseline** (the process holding the model's own weights). Under",
        f"torch.no_grad() it then builds the variant and makes {calls} calls on the same inputs; **peak** is the",
        "highest RSS from the baseline on (VmHWM), so compilation counts: lort's first call (capture,",
        "translation, thread timing in throwaway sessions, the session), the whole-model export, session",
        "and check against eager. **kept**: RSS after the calls, gc.collect() and malloc_trim(0).",
        "",
        "- eager: the module itself.",
        "- lort-frozen: `torch.compile(model, backend=\"lort\", options={\"freeze\": \"auto\", \"disk_cache\": False,",
        "  \"progress\": False})`; lort-unfrozen: the same with `\"freeze\": False` (weights as graph inputs).",
        "- whole-ORT: benchmarks/whole_ort.py's `whole_ort_step(model, args, \"cpu\")` (torch.onnx.export",
        "  dynamo=True, weights as initializers, one session at ORT_ENABLE_ALL, IOBinding).",
        "- weights: the state dict's bytes, each storage once. All memory figures in MiB.",
        "",
        f"Peak read by: {', '.join(sorted(methods))} (reset by writing 5 to /proc/self/clear_refs just before",
        "the variant is built). Ratios compare growths over the baseline; \"-\" where the denominator grew by",
        "less than 1 MiB.",
        "",
        HEADER,
        *[format_row(name, r) for name, r in rows],
        "",
        *geomeans(rows),
        "",
        "The same figures in copies of the weights: (RSS - baseline) / weights (\"-\" under 1 MiB of weights).",
        "The last two columns split the peak growth (MiB) into the first call (capture and compile) and",
        "calls 2-N.",
        "",
        COPIES_HEADER,
        *[format_copies(name, r) for name, r in rows],
        "",
        *notes(rows),
    ]
    return "\n".join(lines).rstrip() + "\n"


#: What follows this line in the output file is kept when the figures are written again.
READING_MARKER = "<!-- reading: kept by freeze_memory.py, update it with the figures -->"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--calls", type=int, default=20, help="calls per process (the first compiles)")
    ap.add_argument("--out", help="default benchmarks/results/frozen_memory.md "
                    "(frozen_memory_large.md with --sizes cuda)")
    ap.add_argument("--json", help="also write the raw figures (bytes) to this file")
    ap.add_argument("--from-json", help="measure nothing: write the report of the figures in this file "
                    "(a --json file of an earlier run; its header keeps that run's seconds)")
    ap.add_argument("--sizes", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: the models at issue 10's sizes (lort.testing.models.CUDA_CASES), still on CPU")
    a = ap.parse_args(argv)
    from lort.testing.models import CASES, CUDA_CASES

    a.out = a.out or report.result_path("frozen_memory_large.md" if a.sizes == "cuda" else "frozen_memory.md")
    if a.sizes == "cuda":
        CASES = CUDA_CASES
        if a.models == DEFAULT_MODELS:
            a.models = ",".join(CUDA_CASES)

    models = [m for m in a.models.split(",") if m]
    for m in models:
        if m not in CASES:
            ap.error(f"unknown model {m!r}; choose from {list(CASES)}")
    if a.calls < 2:
        ap.error("--calls must be at least 2")
    if a.from_json:
        with open(a.from_json) as f:
            saved = json.load(f)
        mach, elapsed, a.calls = saved["machine"], saved["seconds"], saved["calls"]
        rows = [(name, r) for name, r in saved["rows"].items()]
        methods = {x["method"] for _, r in rows for x in r.values() if "method" in x}
    else:
        mach = report.machine()
        print(mach)
        print(HEADER, flush=True)
        rows, methods = [], set()
        t0 = time.perf_counter()
        for name in models:
            r = {v: measure(name, v, a.calls, a.sizes) for v in VARIANTS}
            methods.update(x["method"] for x in r.values() if "method" in x)
            rows.append((name, r))
            print(format_row(name, r), flush=True)
        elapsed = time.perf_counter() - t0
    text = render(rows, mach, a.calls, elapsed, methods, a.sizes)
    if os.path.exists(a.out):  # a hand-written reading of the figures stays below the marker
        with open(a.out) as f:
            old = f.read()
        if READING_MARKER in old:
            text += "\n" + old[old.index(READING_MARKER):]
    report.write_file(a.out, text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(machine=mach, seconds=elapsed, calls=a.calls, rows=dict(rows)), f, indent=1)
    print(text[text.index("- geomean"):] if "- geomean" in text else "")
    print(f"{elapsed:.0f} s; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
