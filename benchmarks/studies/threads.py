"""ORT thread settings: lort variants side by side with eager, in one process, on CPU.

For each model and scenario (infer1 / infer8: inference under no_grad at batch 1 / 8;
train: forward + backward at batch 8), the lort variants of ``VARIANTS`` (thread counts
and spinning), all with executor="ort" so that every group runs in ORT (a hybrid graph
such as resnet18's training graph then alternates ORT groups with PyTorch ops,
convolution_backward among them).

Each variant compiles its own deep copy of the model with its own lort.LortBackend
(checked: every backend records graphs), and all of them plus eager are timed
round-robin (benchmarks/timing.py's timed_interleaved), median of repeats. Prints a table
of ms and speed-ups over eager and writes it to benchmarks/studies/threads.md.

    python benchmarks/studies/threads.py [--models mlp,bert,resnet18] [--scenarios infer1,infer8,train] [--min-time 1]
"""

from __future__ import annotations

import argparse
import collections
import copy
import datetime
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this study's folder, then benchmarks/ (the shared modules)

from report import machine  # noqa: E402
from run import SCENARIOS  # noqa: E402
from timing import timed_interleaved  # noqa: E402

import lort  # noqa: E402
from lort.testing.models import CASES, output_tensor  # noqa: E402

#: name -> lort options (beside COMMON). intra_op_num_threads=None: per group, 1 thread
#: or torch's thread count, chosen by timing (lort's default).
VARIANTS = {
    "a": {"intra_op_num_threads": None, "allow_spinning": False},
    "b": {"intra_op_num_threads": None, "allow_spinning": True, "force_spinning_stop": True},
    "c": {"intra_op_num_threads": 2, "allow_spinning": True, "force_spinning_stop": True},
    "d": {"intra_op_num_threads": 2, "allow_spinning": True, "force_spinning_stop": False},
}
COMMON = {"executor": "ort", "disk_cache": False}


def make_step(model, args, kind, fn):
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
    return step


def describe(backend):
    """Groups in ORT, ATen nodes left to PyTorch, and the thread counts the groups got."""
    groups = [g for r in backend.records for g in r.groups if g.executor == "ort"]
    torch_nodes = sum(r.torch_nodes for r in backend.records)
    threads = collections.Counter(g.threads for g in groups)
    chosen = " ".join(f"{n}x{t}t" for t, n in sorted(threads.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))
    return dict(graphs=len(backend.records), groups=len(groups), torch_nodes=torch_nodes, threads=chosen)


def run(models, scenarios, min_time):
    rows = []
    for name in models:
        for scenario in scenarios:
            kind, batch = SCENARIOS[scenario]
            torch._dynamo.reset()
            model, args = CASES[name].make(batch, seed=0)
            if kind == "inference":
                model.eval()
            steps, firsts, backends = {"eager": make_step(model, args, kind, model)}, {}, {}
            for v, opts in VARIANTS.items():
                m = copy.deepcopy(model)
                backend = lort.LortBackend({**COMMON, **opts})
                step = make_step(m, args, kind, torch.compile(m, backend=backend))
                t0 = time.perf_counter()
                step()
                firsts[v] = time.perf_counter() - t0
                if not backend.records:
                    raise RuntimeError(f"{name} {scenario}: variant {v} compiled no graph of its own")
                steps[v], backends[v] = step, backend
            # A pause after each sample: threads left spinning must not slow the next variant.
            times = timed_interleaved(steps, min_time * len(steps), settle_s=0.05)
            row = dict(
                model=name,
                scenario=scenario,
                times=times,
                firsts=firsts,
                info={v: describe(b) for v, b in backends.items()},
            )
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def format_row(row):
    t = row["times"]
    cells = [f"{t['eager'] * 1e3:.3f}"]
    for v in VARIANTS:
        cells.append(f"{t[v] * 1e3:.3f} ({t['eager'] / t[v]:.2f}x)")
    info = row["info"]["a"]
    chosen = ", ".join(f"{v}: {row['info'][v]['threads']}" for v in VARIANTS
                       if VARIANTS[v]["intra_op_num_threads"] is None and row["info"][v]["threads"])
    return (
        f"| {row['model']} | {row['scenario']} | " + " | ".join(cells) + f" | {info['groups']} / {info['torch_nodes']} "
        f"| {chosen or '-'} |"
    )


HEADER = (
    "| model | run | eager ms | " + " | ".join(f"{v} ms" for v in VARIANTS)
    + " | ORT groups / ATen nodes in PyTorch | threads chosen |\n"
    "|---|---|---:|" + "---:|" * len(VARIANTS) + "---:|---|"
)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,bert,resnet18")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds of timed calls per variant")
    ap.add_argument("--out", default=os.path.join(HERE, "threads.md"))
    a = ap.parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    scenarios = [s for s in a.scenarios.split(",") if s]
    for m in models:
        if m not in CASES:
            ap.error(f"unknown model {m!r}; choose from {list(CASES)}")
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}; choose from {list(SCENARIOS)}")
    # Five compiled copies of one forward: keep Dynamo from giving up on recompiles.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
    mach = machine()
    print(mach)
    print(HEADER, flush=True)
    t0 = time.perf_counter()
    rows = run(models, scenarios, a.min_time)
    elapsed = time.perf_counter() - t0
    lines = [
        "# ORT thread settings",
        "",
        f"Taken {datetime.date.today().isoformat()} by `python benchmarks/studies/threads.py` ({elapsed:.0f} s in all; "
        "eager and all lort variants side by side in one process).",
        f"Machine: {mach}.",
        "",
        "lort variants, all with `executor=\"ort\"` (every group runs in ORT, none moved back to PyTorch by",
        "timing) and `disk_cache=False` (thread choices made afresh); each compiles its own deep copy of the",
        "model with its own `lort.LortBackend`:",
        "",
        *[f"- {v}: " + ", ".join(f"`{k}={o!r}`" for k, o in opts.items()) for v, opts in VARIANTS.items()],
        "",
        "`intra_op_num_threads=None`: per group, 1 thread or torch's thread count, chosen by timing (lort's",
        "default). `allow_spinning`: ORT's threads spin while they wait for work in a run;",
        "`force_spinning_stop`: they stop when the run returns. Times are the median of 11 samples per",
        "variant, taken round-robin with eager, with a 50 ms pause after each sample so that threads left",
        "spinning do not slow the variant timed next; in",
        "brackets the speed-up over eager (eager time / variant time, above 1 = faster than eager).",
        "infer1/infer8: inference under no_grad at batch 1 / 8; train: forward + backward at batch 8.",
        "ORT groups / ATen nodes in PyTorch: over all of variant a's graphs (nodes in PyTorch > 0 = hybrid",
        "graph). Threads chosen: each timed variant's groups by thread count (e.g. 3x1t = three groups on 1 thread).",
        "",
        HEADER,
        *[format_row(r) for r in rows],
        "",
    ]
    for s in scenarios:
        sel = [r for r in rows if r["scenario"] == s]
        if sel:
            parts = [
                f"{v} {statistics.geometric_mean([r['times']['eager'] / r['times'][v] for r in sel]):.2f}x"
                for v in VARIANTS
            ]
            lines.append(f"- {s}: geomean speed-up over eager: " + ", ".join(parts))
    text = "\n".join(lines) + "\n"
    with open(a.out, "w") as f:
        f.write(text)
    print("\n".join(lines[-len(scenarios):]))
    print(f"{elapsed:.0f} s; wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
