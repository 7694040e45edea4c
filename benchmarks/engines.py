"""Training steps with inductor as lort's third engine (compile/engines.py), beside eager
and inductor, at real sizes.

One fresh process per case holds four copies of the model with the same initial
weights, each with its AdamW optimizer: eager PyTorch, ``torch.compile`` (inductor),
``torch.compile(backend="lort")`` and ``lort.ORTModule``, both lort front ends with
``executor="auto"`` and the engines given (default ort, pytorch, inductor). A step is
forward, loss, backward, optimizer step and ``zero_grad``. It reports:

- **first s**: each backend's first step, compile included (lort's disk cache off,
  inductor's caches in a new empty directory shared by the compiled backends: lort's
  inductor compiles run after torch.compile's, so they may find kernels compiled);
- **final s**: each lort front end, seconds from its first step until every graph's
  engine was chosen (inductor traced on the second step, compiled in its subprocess,
  then timed), stepping that front end meanwhile (torch.compile's lort first, then
  ORTModule; the time spent on the other is not counted); the second step's seconds
  (inductor's trace included), the steps taken meanwhile and their median;
- **steady ms**: median of ``--rounds`` rounds where the four step in turn (order
  rotated every round), after settling; ratios are eager / backend and inductor /
  backend per round, their median;
- each graph's engine, and the times it was chosen by.

    python -m benchmarks training [--cases bert_base,gpt2_small] [--batch 4] [--rounds 20]
        (cases: bert_base, gpt2_small, resnet50 (timm, 224 px), vit_small (timm ViT-S/16),
         llama_small (a 0.2B Llama-style causal LM))
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
options = {"executor": "auto", "engines": engines, "disk_cache": False}
backend = lort.LortBackend(options)
NAMES = ("eager", "inductor", "lort", "ortmodule")
steps, modules = {}, {}
for name in NAMES:
    m = copy.deepcopy(model)
    if name == "ortmodule":
        fn = modules[name] = lort.ORTModule(m, options=options)
    else:
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
for name in NAMES:
    t0 = time.perf_counter()
    steps[name]()
    first[name] = time.perf_counter() - t0
    gc.collect()
def backends(name):
    if name == "lort":
        return [backend]
    return [e.backend for e in modules[name].transition_manager.entries.values() if e.backend is not None]
def switches(name):
    return [s for b in backends(name) for s in (r() for r in b.switches) if s is not None]
def records(name):
    return [r for b in backends(name) for r in b.records]
def settled(name):
    return all(s.engine is not None for s in switches(name))
final, meanwhile = {}, {}
for name in ("lort", "ortmodule"):  # lort's steps until every engine is chosen, then ORTModule's
    start = time.perf_counter() - first[name]
    meanwhile[name] = []
    while not settled(name) and time.perf_counter() - start < 3600:
        t0 = time.perf_counter()
        steps[name]()
        meanwhile[name].append(time.perf_counter() - t0)
    final[name] = time.perf_counter() - start
for name in steps:  # warm-up after the swap
    steps[name]()
times = {n: [] for n in steps}
order = list(NAMES)
for r in range(rounds):
    for name in order[r % 4:] + order[:r % 4]:
        t0 = time.perf_counter()
        steps[name]()
        times[name].append(time.perf_counter() - t0)
def med(xs):
    return statistics.median(xs) if xs else None
def ratio(a, b):
    return med([x / y for x, y in zip(times[a], times[b])])
out = {
    "first": first, "final": final, "meanwhile": {n: len(m) for n, m in meanwhile.items()},
    "meanwhile_ms": {n: (med(m) or 0) * 1e3 for n, m in meanwhile.items()},
    "second_s": {n: m[0] if m else None for n, m in meanwhile.items()},
    "steady_ms": {n: med(t) * 1e3 for n, t in times.items()},
    "lort_vs_eager": ratio("eager", "lort"), "lort_vs_inductor": ratio("inductor", "lort"),
    "inductor_vs_eager": ratio("eager", "inductor"),
    "ortmodule_vs_eager": ratio("eager", "ortmodule"), "ortmodule_vs_inductor": ratio("inductor", "ortmodule"),
    "graphs": {n: [(r.name, str(r.executor), {k: round(v * 1e3, 3) for k, v in r.executor_times.items()
                                              if isinstance(v, float)}) for r in records(n)]
               for n in ("lort", "ortmodule")},
    "switches": {n: [dict(engine=s.engine, trace_s=s.trace_s, compile_s=s.compile_s) for s in switches(n)]
                 for n in ("lort", "ortmodule")},
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


def _chosen(graphs) -> str:
    return "; ".join(f"{name}: {engine} ({', '.join(f'{k} {v:.1f} ms' for k, v in t.items())})"
                     for name, engine, t in graphs)


def _final(r: dict, name: str) -> str:
    second = r["second_s"][name]
    return (f"{'-' if second is None else format(second, '.1f')} | {r['final'][name]:.1f} "
            f"({r['meanwhile'][name]}, {r['meanwhile_ms'][name]:.0f})")


def table(results: dict, batch: int) -> list[str]:
    lines = [
        "| case | eager ms | inductor ms | lort ms | ORTModule ms | lort vs eager | lort vs inductor "
        "| ORTModule vs eager | ORTModule vs inductor | inductor vs eager "
        "| first s eager / inductor / lort / ORTModule | lort 2nd step s | lort final s (steps meanwhile, their "
        "median ms) | ORTModule 2nd step s | ORTModule final s (steps meanwhile, their median ms) "
        "| engines chosen, lort | engines chosen, ORTModule |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---|---|---|",
    ]
    for case, r in results.items():
        s, f = r["steady_ms"], r["first"]
        lines.append(
            f"| {case} train, batch {batch} {ENGINE_SAMPLE[case]} | {s['eager']:.1f} | {s['inductor']:.1f} | "
            f"{s['lort']:.1f} | {s['ortmodule']:.1f} | {r['lort_vs_eager']:.2f}x | {r['lort_vs_inductor']:.2f}x | "
            f"{r['ortmodule_vs_eager']:.2f}x | {r['ortmodule_vs_inductor']:.2f}x | {r['inductor_vs_eager']:.2f}x | "
            f"{f['eager']:.1f} / {f['inductor']:.1f} / {f['lort']:.1f} / {f['ortmodule']:.1f} | "
            f"{_final(r, 'lort')} | {_final(r, 'ortmodule')} | {_chosen(r['graphs']['lort'])} | "
            f"{_chosen(r['graphs']['ortmodule'])} |")
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
        for front, switches in r["switches"].items():
            for s in switches:
                trace = "-" if s["trace_s"] is None else f"{s['trace_s']:.1f} s"
                ready = "never (it failed)" if s["compile_s"] is None else f"{s['compile_s']:.1f} s after the capture"
                lines.append(f"- {case}, {front}: inductor's trace on the caller's thread {trace}; ready and timed "
                             f"{ready}; engine {s['engine']}")
    report.write_section(a.out, f"engines {a.cases} {a.batch} {a.engines}", lines,
                         title="# Engines: lort with inductor as its third engine")


if __name__ == "__main__":
    main()
