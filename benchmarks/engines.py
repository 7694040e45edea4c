"""Training steps with inductor as lort's third engine (compile/engines.py), beside eager
and inductor, at real sizes.

One fresh process per case holds three copies of the model with the same initial
weights, each with its AdamW optimizer: eager PyTorch, ``torch.compile`` (inductor) and
``torch.compile(backend="lort")`` with ``executor="auto"`` and the engines given
(default ort, pytorch, inductor). A step is forward, loss, backward, optimizer step and
``zero_grad``. It reports:

- **first s**: each backend's first step, compile included (lort's disk cache off,
  inductor's caches in a new empty directory shared by both compiled backends: lort's
  inductor compile runs after torch.compile's, so it may find kernels compiled);
- **final s**: lort only, seconds from its first step until every graph's engine was
  chosen (inductor traced on lort's second step, compiled in its subprocess, then timed),
  stepping lort meanwhile; the second step's seconds (inductor's trace included), the
  steps taken meanwhile and their median;
- **steady ms**: median of ``--rounds`` rounds where the three step in turn (order
  rotated every round), after settling; ratios are eager / backend and inductor / lort
  per round, their median;
- each graph's engine, and the times it was chosen by.

    python -m benchmarks training [--cases bert_base,gpt2_small] [--batch 4] [--rounds 20]
        (cases: bert_base, gpt2_small, resnet50 (timm, 224 px), vit_small (timm ViT-S/16))
        [--engines ort,pytorch,inductor]

Writes benchmarks/results/training.md (``--out``), replacing the section for its command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402
from lort.testing.models import ENGINE_SAMPLE  # noqa: E402

CHILD = r"""
import copy, gc, json, statistics, sys, time
import torch
from lort.testing.models import make_torchvision_importable, output_tensor
make_torchvision_importable()
import lort
from lort.testing import models
case, batch, rounds, engines = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), tuple(sys.argv[4].split(","))
model, args, kwargs = models.ENGINE_CASES[case](batch)
model.train(True)
backend = lort.LortBackend({"executor": "auto", "engines": engines, "disk_cache": False})
fns, steps = {}, {}
for name in ("eager", "inductor", "lort"):
    m = copy.deepcopy(model)
    fn = {"eager": m, "inductor": torch.compile(m), "lort": torch.compile(m, backend=backend)}[name]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    def step(fn=fn, opt=opt):
        out = fn(*args, **kwargs)
        loss = out.loss if getattr(out, "loss", None) is not None else output_tensor(out).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    steps[name] = step
del model
first = {}
for name in ("eager", "inductor", "lort"):
    t0 = time.perf_counter()
    steps[name]()
    first[name] = time.perf_counter() - t0
    gc.collect()
start = time.perf_counter() - first["lort"]
meanwhile = []
def settled():
    sw = [r() for r in backend.switches]
    return all(s is None or s.engine is not None for s in sw)
while not settled() and time.perf_counter() - start < 3600:
    t0 = time.perf_counter()
    steps["lort"]()
    meanwhile.append(time.perf_counter() - t0)
final = time.perf_counter() - start
for name in steps:  # warm-up after the swap
    steps[name]()
times = {n: [] for n in steps}
order = ["eager", "inductor", "lort"]
for r in range(rounds):
    for name in order[r % 3:] + order[:r % 3]:
        t0 = time.perf_counter()
        steps[name]()
        times[name].append(time.perf_counter() - t0)
def med(xs):
    return statistics.median(xs) if xs else None
out = {
    "first": first, "final": final, "meanwhile": len(meanwhile), "meanwhile_ms": (med(meanwhile) or 0) * 1e3,
    "second_s": meanwhile[0] if meanwhile else None,
    "steady_ms": {n: med(t) * 1e3 for n, t in times.items()},
    "lort_vs_eager": med([e / l for e, l in zip(times["eager"], times["lort"])]),
    "lort_vs_inductor": med([i / l for i, l in zip(times["inductor"], times["lort"])]),
    "inductor_vs_eager": med([e / i for e, i in zip(times["eager"], times["inductor"])]),
    "graphs": [(r.name, str(r.executor), {k: round(v * 1e3, 3) for k, v in r.executor_times.items()
                                           if isinstance(v, float)}) for r in backend.records],
    "switches": [dict(engine=s.engine, trace_s=s.trace_s, compile_s=s.compile_s)
                 for s in (r() for r in backend.switches) if s is not None],
}
print(json.dumps(out))
"""


def run_child(code: str, case: str, batch: int, rounds: int, engines: str, timeout: int) -> dict:
    """``code`` run in a fresh Python for one case (its argv: case, batch, rounds, engines,
    benchmarks/), inductor's caches in a new empty directory: the JSON of its last line."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, LORT_PROGRESS="0")
        done = subprocess.run([sys.executable, "-c", code, case, str(batch), str(rounds), engines, HERE],
                              capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{case}: the child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_case(case: str, batch: int, rounds: int, engines: str, timeout: int) -> dict:
    return run_child(CHILD, case, batch, rounds, engines, timeout)


def table(results: dict, batch: int) -> list[str]:
    lines = [
        "| case | eager ms | inductor ms | lort ms | lort vs eager | lort vs inductor | inductor vs eager "
        "| first s eager / inductor / lort | lort 2nd step s | lort final s (steps meanwhile, their median ms) "
        "| engines chosen |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---|---|",
    ]
    for case, r in results.items():
        s, f = r["steady_ms"], r["first"]
        chosen = "; ".join(f"{name}: {engine} ({', '.join(f'{k} {v:.1f} ms' for k, v in t.items())})"
                           for name, engine, t in r["graphs"])
        lines.append(
            f"| {case} train, batch {batch} {ENGINE_SAMPLE[case]} | {s['eager']:.1f} | {s['inductor']:.1f} | {s['lort']:.1f} | "
            f"{r['lort_vs_eager']:.2f}x | {r['lort_vs_inductor']:.2f}x | {r['inductor_vs_eager']:.2f}x | "
            f"{f['eager']:.1f} / {f['inductor']:.1f} / {f['lort']:.1f} | "
            f"{'-' if r['second_s'] is None else format(r['second_s'], '.1f')} | {r['final']:.1f} ({r['meanwhile']}, "
            f"{r['meanwhile_ms']:.0f}) | {chosen} |")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="bert_base,gpt2_small")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--engines", default="ort,pytorch,inductor")
    ap.add_argument("--timeout", type=int, default=5400)
    ap.add_argument("--out", default=report.result_path("training.md"))
    a = ap.parse_args(argv)
    results = {}
    for case in a.cases.split(","):
        results[case] = run_case(case, a.batch, a.rounds, a.engines, a.timeout)
        print(case, json.dumps(results[case]), flush=True)
    lines = [f"## `{report.command('training', argv)}`", "",
             f"Taken {datetime.date.today()} on {report.machine()}.", "", *table(results, a.batch), ""]
    for case, r in results.items():
        for s in r["switches"]:
            trace = "-" if s["trace_s"] is None else f"{s['trace_s']:.1f} s"
            ready = "never (it failed)" if s["compile_s"] is None else f"{s['compile_s']:.1f} s after the capture"
            lines.append(f"- {case}: inductor's trace on the caller's thread {trace}; ready and timed {ready}; "
                         f"engine {s['engine']}")
    report.write_section(a.out, f"engines {a.cases} {a.batch} {a.engines}", lines,
                         title="# Engines: lort with inductor as its third engine")


if __name__ == "__main__":
    main()
