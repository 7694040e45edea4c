"""Encoder inference with 8-bit dynamic quantization (Options.quantize="int8_dynamic",
issue 45): BERT-base at batch 1 and 8 (128 tokens) against eager float32, PyTorch's own
dynamic quantization and lort float32.

Backends, each in a fresh process with empty caches:

- ``eager``: float32;
- ``torch_dynamic``: ``torch.ao.quantization.quantize_dynamic(model, {nn.Linear},
  dtype=torch.qint8)``, PyTorch's eager dynamic quantization (deprecated in favour of
  torchao, still in torch 2.13; per-tensor int8 weights, activations with a reduced range);
- ``torchao_int8_dynamic``: torchao's ``Int8DynamicActivationInt8WeightConfig`` under
  ``torch.compile`` (inductor), PyTorch's way now; where torchao is installed
  (``make bench-peers``);
- ``lort``: ``torch.compile(model, backend="lort", options={"executor": "ort"})``;
- ``lort_int8_dynamic``: the same with ``quantize="int8_dynamic"``.

Each process times its backend and eager float32 on the same model, interleaved
(``timing.timed_interleaved``, about ``--min-time`` seconds each): the speed of a 2-core VM
drifts by 20% between processes, not within one. So every process holds the float32
model (torch.ao's quantize_dynamic returns a copy; torchao's quantize_ works on a copy).

Figures: **first s** (the first call, compiles included), **ms / call** (median of the
samples), **vs eager** (eager's ms / call in the same process over this backend's),
**RSS MiB** after the timed calls and its peak, and **rel. error**: ||out - eager's|| /
||eager's|| over the last hidden state, the quantization's own error for the quantized
rows.

    python -m benchmarks quantized-encoder [--cases bert_base_b1,bert_base_b8] [--backends ...]

Writes the ``quantized-encoder`` section of benchmarks/results/quantized_decoding.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402
from scale import grid_arguments, grid_choices, run_grid  # noqa: E402

BACKENDS = ["eager", "torch_dynamic", "torchao_int8_dynamic", "lort", "lort_int8_dynamic"]
CASES = ["bert_base_b1", "bert_base_b8"]

CHILD = r"""
import json, sys, time, warnings
import torch
sys.path.insert(0, sys.argv[1])
import rss, timing
from lort.testing.models import bert_base
case, backend, min_time = sys.argv[2], sys.argv[3], float(sys.argv[4])
torch.set_grad_enabled(False)
model, (ids,) = bert_base(batch=int(case.rsplit("_b", 1)[1]), seq=128)
model.eval()
want = model(ids).last_hidden_state
if backend == "torch_dynamic":
    warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notices
    from torch.ao.quantization import quantize_dynamic
    run = quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
elif backend == "torchao_int8_dynamic":
    import copy
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    run = copy.deepcopy(model)  # quantize_ works in place; eager's model stays for the interleaved timing
    quantize_(run, Int8DynamicActivationInt8WeightConfig())
    run = torch.compile(run)
elif backend.startswith("lort"):
    import lort
    options = {"executor": "ort"}
    if backend != "lort":
        options["quantize"] = "int8_dynamic"
    run = torch.compile(model, backend="lort", options=options)
else:
    run = model
t0 = time.perf_counter()
out = run(ids).last_hidden_state
first = time.perf_counter() - t0
fns = {"eager": lambda: model(ids)}
if backend != "eager":
    fns[backend] = lambda: run(ids)
t = timing.timed_interleaved(fns, min_time=min_time)
s = rss.status()
print(json.dumps({"first": first, "per_call": t[backend], "vs_eager": t["eager"] / t[backend], "rss": s["VmRSS"],
                  "peak": s["VmHWM"], "rel": ((out - want).norm() / want.norm()).item()}))
"""


def table(results: dict) -> list[str]:
    def heading(case, by_backend):
        model, batch = case.rsplit("_b", 1)
        return f"### {model}, batch {batch} x 128 tokens"

    def row(b, r, by_backend):
        e = by_backend.get("eager", {})
        vs = f"{r['vs_eager']:.2f}x"
        mem = f"{r['rss'] / e['rss']:.2f}x" if "rss" in e else "-"
        return (f"| {b} | {r['first']:.1f} | {r['per_call'] * 1e3:.1f} | {vs} | {r['rss'] / 2**20:.0f} "
                f"| {r['peak'] / 2**20:.0f} | {mem} | {r['rel']:.2e} |")

    return report.case_tables(
        results, heading,
        "| backend | first s | ms / call | vs eager | RSS MiB | peak RSS MiB | RSS vs eager | rel. error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|", row)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    grid_arguments(ap, CASES, BACKENDS)
    ap.add_argument("--min-time", type=float, default=10.0)
    ap.add_argument("--out", default=report.result_path("quantized_decoding.md"))
    a = ap.parse_args(argv)
    results = run_grid(CHILD, *grid_choices(ap, a, CASES, BACKENDS), str(a.min_time))
    stamp = f"Taken {datetime.date.today()} by `{report.command('quantized-encoder', argv)}`."
    report.write_section(a.out, "quantized-encoder", [stamp, report.machine_line(), report.peers_line(("torchao",)), "",
                                                    *table(results)],
                         title="# Quantized decoding (Options.quantize)")


if __name__ == "__main__":
    main()
