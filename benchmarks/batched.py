"""Batched inference at real sizes (issue 43, item 6): eager, inductor, lort through
``torch.compile`` and through ``lort.ORTModule``, and the whole model exported to ORT,
interleaved in one process per case, after lort's engines are chosen.

One fresh process per (case, batch) holds the model once (eval mode, no grad; every
backend runs the same weights, which none of them changes): eager PyTorch,
``torch.compile`` (inductor), ``torch.compile(backend="lort")`` and ``lort.ORTModule``
with ``executor="auto"`` and the engines given (default ort, pytorch, inductor; lort's
disk cache off), and the whole model in one ORT session (benchmarks/whole_ort.py). It
reports:

- **first s**: each backend's first call, compile included (inductor's caches in a new
  empty directory shared by the three compiling backends, in the order inductor, lort,
  ORTModule: lort's background compiles may find kernels already compiled; whole ORT:
  export and session);
- **final s**: for each lort front end, seconds from its first call until every graph's
  engine was chosen (inductor compiled in its subprocess from the second call, then
  timed), calling it meanwhile;
- **steady ms**: median of ``--rounds`` rounds where the backends run in turn (order
  rotated every round); ratios are the median over rounds of the other's time / lort's;
- each lort graph's engine and the times it was chosen by.

    python -m benchmarks batched [--cases bert_base,gpt2_small,vit_small,resnet50] [--batch 8] [--rounds 10]
        [--engines ort,pytorch,inductor]

Writes benchmarks/results/batched_inference.md (``--out``), replacing the section for its command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402
from engines import run_child  # noqa: E402
from lort.testing.models import ENGINE_SAMPLE  # noqa: E402

CHILD = r"""
import gc, json, statistics, sys, time
import torch
sys.path.insert(0, sys.argv[5])
from lort.testing.models import make_torchvision_importable, output_tensor
make_torchvision_importable()
import lort
from lort.testing import models
from whole_ort import whole_ort_step
case, batch, rounds, engines = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), tuple(sys.argv[4].split(","))
model, args, _ = models.ENGINE_CASES[case](batch)  # no labels: the forward's output
if case == "gpt2_small":  # a forward's logits; no cache object to return (ORTModule's direct path)
    model.config.use_cache = False
model.eval()
opts = {"executor": "auto", "engines": engines, "disk_cache": False, "progress": False}
backend = lort.LortBackend(opts)
fns = {"eager": model, "inductor": torch.compile(model), "lort": torch.compile(model, backend=backend),
       "ortmodule": lort.ORTModule(model, options=opts)}
def switches(name):
    if name == "lort":
        refs = backend.switches
    else:
        refs = [r for e in fns["ortmodule"].transition_manager.entries.values() if e.backend is not None
                for r in e.backend.switches]
    return [s for s in (r() for r in refs) if s is not None]
first, final, meanwhile, calls, out0 = {}, {}, {}, {}, {}
with torch.no_grad():
    want = output_tensor(model(*args))
    for name in ("eager", "inductor", "lort", "ortmodule"):
        t0 = time.perf_counter()
        out0[name] = output_tensor(fns[name](*args))
        first[name] = time.perf_counter() - t0
        gc.collect()
    for name in ("lort", "ortmodule"):
        start, n, during = time.perf_counter() - first[name], 0, []
        while time.perf_counter() - start < 3600:
            t0 = time.perf_counter()
            fns[name](*args)
            during.append(time.perf_counter() - t0)
            if all(s.engine is not None for s in switches(name)):
                break
        final[name], meanwhile[name] = time.perf_counter() - start, len(during)
    t0 = time.perf_counter()
    whole = whole_ort_step(model, args)
    first["whole"] = time.perf_counter() - t0
    if callable(whole):
        fns["whole"] = lambda *a: whole()
    for name, fn in fns.items():  # warm-up after the swaps
        fn(*args)
    err = {n: (output_tensor(fns[n](*args)) - want).abs().max().item() for n in fns if n != "whole"}
    times = {n: [] for n in fns}
    order = list(fns)
    for r in range(rounds):
        k = r % len(order)
        for name in order[k:] + order[:k]:
            t0 = time.perf_counter()
            fns[name](*args)
            times[name].append(time.perf_counter() - t0)
def med(xs):
    return statistics.median(xs) if xs else None
def ratio(a, b):
    return med([x / y for x, y in zip(times[a], times[b])]) if times.get(a) and times.get(b) else None
records = {"lort": backend.records,
           "ortmodule": [r for e in fns["ortmodule"].transition_manager.entries.values() if e.backend is not None
                         for r in e.backend.records]}
out = {
    "first": first, "final": final, "meanwhile": meanwhile, "max_abs_err": err,
    "whole": None if callable(whole) else whole,
    "steady_ms": {n: med(t) * 1e3 for n, t in times.items()},
    "ratios": {f"{a}/{b}": ratio(b, a) for a in ("lort", "ortmodule") for b in ("eager", "inductor", "whole")},
    "inductor_vs_eager": ratio("eager", "inductor"),
    "graphs": {k: [(r.name, str(r.executor), {n: round(v * 1e3, 2) for n, v in r.executor_times.items()
                                              if isinstance(v, float)}) for r in recs] for k, recs in records.items()},
}
print(json.dumps(out))
"""


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _engines(graphs: list) -> str:
    return "; ".join(f"{engine} ({', '.join(f'{k} {v:.1f} ms' for k, v in t.items())})" for _, engine, t in graphs)


def table(results: dict) -> list[str]:
    lines = [
        "| case | eager ms | inductor ms | whole ORT ms | lort ms | ORTModule ms | lort vs eager / inductor / whole ORT "
        "| ORTModule vs eager / inductor / whole ORT | first s eager / inductor / lort / ORTModule / whole ORT "
        "| final s lort / ORTModule | engine lort | engine ORTModule |",
        "|---|---:|---:|---:|---:|---:|---|---|---|---|---|---|",
    ]
    for (case, batch), r in results.items():
        s, f, q = r["steady_ms"], r["first"], r["ratios"]
        whole = "-" if s.get("whole") is None else f"{s['whole']:.1f}"
        lines.append(
            f"| {case}, batch {batch} {ENGINE_SAMPLE[case]} | {s['eager']:.1f} | {s['inductor']:.1f} | {whole} | {s['lort']:.1f} | "
            f"{s['ortmodule']:.1f} | {_x(q['lort/eager'])} / {_x(q['lort/inductor'])} / {_x(q['lort/whole'])} | "
            f"{_x(q['ortmodule/eager'])} / {_x(q['ortmodule/inductor'])} / {_x(q['ortmodule/whole'])} | "
            f"{f['eager']:.1f} / {f['inductor']:.1f} / {f['lort']:.1f} / {f['ortmodule']:.1f} / {f['whole']:.1f} | "
            f"{r['final']['lort']:.0f} / {r['final']['ortmodule']:.0f} | {_engines(r['graphs']['lort'])} | "
            f"{_engines(r['graphs']['ortmodule'])} |")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="bert_base,gpt2_small,vit_small,resnet50")
    ap.add_argument("--batch", default="8", help="comma-separated batch sizes")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--engines", default="ort,pytorch,inductor")
    ap.add_argument("--timeout", type=int, default=5400)
    ap.add_argument("--out", default=report.result_path("batched_inference.md"))
    a = ap.parse_args(argv)
    results = {}
    for batch in map(int, a.batch.split(",")):
        for case in a.cases.split(","):
            results[(case, batch)] = run_child(CHILD, case, batch, a.rounds, a.engines, a.timeout)
            print(case, batch, json.dumps(results[(case, batch)]), flush=True)
    lines = [f"## `{report.command('batched', argv)}`", "",
             f"Taken {datetime.date.today()} on {report.machine()}.", "", *table(results), ""]
    for (case, batch), r in results.items():
        if r["whole"] is not None:
            lines.append(f"- {case}, batch {batch}: whole ORT {r['whole']}")
        errs = ", ".join(f"{k} {v:.1e}" for k, v in r["max_abs_err"].items())
        lines.append(f"- {case}, batch {batch}: largest absolute difference from eager's output: {errs}")
    report.write_section(a.out, f"batched {a.cases} {a.batch} {a.engines}", lines,
                         title="# Batched inference at real sizes: eager, inductor, lort, the whole model in ORT")


if __name__ == "__main__":
    main()
