"""A training step beside a busy core: torch's full thread count against one thread fewer.

Issue 43, item 3: while inductor compiles a graph in its subprocess (compile/engines.py),
lort's calls go on, on the placement ready at once. On a 2-core machine the steps taken
meanwhile ran at 2.7x the steady step (benchmarks/results/training.md: ViT-S/16, 6552
against 2438 ms). The compile worker is one busy process, so the question is what the
step loses to it, and whether it loses less with one torch thread fewer (the compile then
has a core of its own).

Each variant runs in a fresh process: ViT-S/16 (timm, random weights) at batch 8, 224 px,
forward, backward and an AdamW step in eager PyTorch, with ``torch.set_num_threads(T)``:
2 warm-up steps, then the median of ``--steps`` steps. "busy" runs a second process that
spins one core (a stand-in for the compile worker) for the variant's whole run. The
variants take turns for ``--rounds`` rounds. The table goes between the file's
``<!-- compile_contention -->`` markers; the reading after them is kept.

    python benchmarks/studies/compile_contention.py [--rounds 2] [--steps 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from report import machine, write_section  # noqa: E402
from timing import median_seconds  # noqa: E402

_SPIN = "while True: pass"


def child(threads: int, steps: int) -> dict:
    import torch

    from lort.testing.models import ENGINE_CASES

    torch.set_num_threads(threads)
    model, args, kwargs = ENGINE_CASES["vit_small"](8)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        model(*args, **kwargs).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {"median_s": median_seconds(step, calls=steps, warmup=2)}


def run(threads: int, busy: bool, steps: int) -> float:
    spinner = subprocess.Popen([sys.executable, "-c", _SPIN]) if busy else None
    try:
        out = subprocess.run([sys.executable, __file__, "--child", str(threads), str(steps)], check=True,
                             capture_output=True, text=True)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])["median_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=os.path.join(HERE, "compile_contention.md"))
    p.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(*a.child)))
        return
    import torch

    full = torch.get_num_threads()
    variants = [(full, False), (full - 1, False), (full, True), (full - 1, True)] if full > 1 else [(1, False)]
    samples: dict = {v: [] for v in variants}
    for _ in range(a.rounds):
        for threads, busy in variants:
            samples[(threads, busy)].append(run(threads, busy, a.steps))
    quiet = statistics.median(samples[(full, False)])
    lines = [
        f"Taken {datetime.date.today()} by `python benchmarks/studies/compile_contention.py --rounds {a.rounds} "
        f"--steps {a.steps}`.",
        f"Machine: {machine()}. ViT-S/16 at batch 8, 224 px, forward, backward and AdamW in eager PyTorch; "
        "ms: median over rounds of each fresh process's median step (range).",
        "",
        "| torch threads | a second process spinning one core | step ms | vs the quiet step at full threads |",
        "|---:|---|---:|---:|",
    ]
    for (threads, busy), values in samples.items():
        med = statistics.median(values)
        lines.append(f"| {threads} | {'yes' if busy else 'no'} | {med * 1e3:.0f} ({min(values) * 1e3:.0f}-"
                     f"{max(values) * 1e3:.0f}) | {med / quiet:.2f}x |")
    print("\n".join(lines))
    write_section(a.out, "compile_contention", lines, title="# A training step beside a busy core\n")

if __name__ == "__main__":
    main()
