"""max_group_args re-checked (issue 13): for each model whose training graphs the limit
splits, the ORT groups and the time of a training step (batch 8, forward + backward)
with the limit at 128 (the default) and with no limit, every group in ORT
(executor="ort"), side by side in one process (run.py's round-robin median); eager
alongside for scale. Inference graphs are not timed here: with frozen weights their
widest group takes 2 to 10 session inputs and outputs (benchmarks/studies/groups.md), so the
limit never splits them. Writes benchmarks/studies/group_args.md.

    python benchmarks/studies/group_args.py [--models resnet18,vit] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this study's folder, then benchmarks/ (the shared modules)
from report import machine  # noqa: E402
from run import model_and_args  # noqa: E402
from timing import timed_interleaved  # noqa: E402

import lort  # noqa: E402
from lort.testing.models import output_tensor  # noqa: E402

LIMITS = {"128": 128, "none": 1 << 30}
MODELS = ["cnn", "resnet18", "mobilenetv3", "vit", "resnet50"]


def train_step(name: str, limit: int | None):
    """(step, backend or None for eager, first-call seconds)."""
    _, model, args = model_and_args(name, "train")
    backend = None
    fn = model
    if limit is not None:
        backend = lort.LortBackend({"executor": "ort", "disk_cache": False, "max_group_args": limit})
        fn = torch.compile(model, backend=backend)
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        for p in params:
            p.grad = None
        output_tensor(fn(*args)).float().pow(2).mean().backward()

    t0 = time.perf_counter()
    step()
    return step, backend, time.perf_counter() - t0


def groups(backend) -> int:
    return sum(len(r.groups) for r in backend.records)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--min-time", type=float, default=1.0)
    ap.add_argument("--out", default=os.path.join(HERE, "group_args.md"))
    a = ap.parse_args(argv)
    rows = []
    for name in a.models.split(","):
        torch._dynamo.reset()
        steps, info = {}, {}
        steps["eager"], _, _ = train_step(name, None)
        for label, limit in LIMITS.items():
            step, backend, first = train_step(name, limit)
            steps[label] = step
            info[label] = (groups(backend), first)
        times = timed_interleaved(steps, min_time=a.min_time)
        row = {"model": name, "eager": times["eager"]}
        for label in LIMITS:
            row[label] = (times[label], *info[label])
        rows.append(row)
        print(name, {k: v for k, v in row.items() if k != "model"}, flush=True)
    lines = [
        "# max_group_args: 128 against no limit (training, every group in ORT)",
        "",
        f"Taken {time.strftime('%Y-%m-%d')} by `python benchmarks/studies/group_args.py`. {machine()}",
        "",
        "Training step at batch 8 (forward + backward), executor=\"ort\" so every group runs in ORT;",
        "median of 11 round-robin samples; first call: capture + compile + first step, seconds.",
        "",
        "| model | eager ms | groups at 128 | ms at 128 | 1st call s | groups, no limit | ms, no limit | 1st call s | no limit / 128 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        (t128, g128, f128), (tn, gn, fn_) = r["128"], r["none"]
        lines.append(
            f"| {r['model']} | {r['eager'] * 1e3:.2f} | {g128} | {t128 * 1e3:.2f} | {f128:.1f} | {gn} | {tn * 1e3:.2f} | {fn_:.1f} | {tn / t128:.2f} |"
        )
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
