"""Is executor="auto" reproducible? The same model compiled in fresh processes.

For each benchmark model (lort.testing.models.CASES) and run (``infer1``: inference at
batch 1; ``train``: a training step at batch 8), ``--runs`` fresh processes with an empty
lort disk cache each compile the model with ``executor="auto"`` and make one call; each
reports its placement: per captured graph, where it runs (lort or eager PyTorch) and
which of its groups run in ORT. The table says how many of the runs gave the most
common placement, and how many choices were close calls (ORT and PyTorch within 5%,
timed again: compile/tuner.py).

    python benchmarks/studies/placement.py [--models mlp,cnn,transformer,bert,resnet18] [--runs 5]

Writes the ``placement`` section of benchmarks/studies/placement.md.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this study's folder, then benchmarks/ (the shared modules)
from report import machine_line, write_section  # noqa: E402
from scale import run_child  # noqa: E402

CHILD = r"""
import json, sys, torch
from lort.testing.models import CASES, make_torchvision_importable, output_tensor
make_torchvision_importable()
import lort
from lort.diagnostics.records import close_call
name, scenario = sys.argv[2], sys.argv[3]
model, args = CASES[name].make(1 if scenario == "infer1" else 8, seed=0)
model.train(scenario == "train")
backend = lort.LortBackend({"executor": "auto"})
cm = torch.compile(model, backend=backend)
if scenario == "train":
    output_tensor(cm(*args)).float().pow(2).mean().backward()
else:
    with torch.no_grad():
        cm(*args)
placement, close = [], 0
for r in backend.records:
    groups = sorted(g.name for g in r.groups if str(g.executor) == "ort")
    placement.append(f"{r.name}:{r.executor}:{','.join(groups)}")
    close += close_call(r.executor_times) + sum(close_call(g.executor_times) for g in r.groups)
print(json.dumps({"placement": "; ".join(placement), "close": close}))
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,cnn,transformer,bert,resnet18")
    ap.add_argument("--scenarios", default="infer1,train")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "placement.md"))
    a = ap.parse_args(argv)
    lines = ["| model | run | same placement | close calls per run | most common placement |",
             "|---|---|---:|---|---|"]
    for name in a.models.split(","):
        for scenario in a.scenarios.split(","):
            results = [run_child(CHILD, name, scenario) for _ in range(a.runs)]
            seen = collections.Counter(r.get("placement", f"failed: {r.get('error')}") for r in results)
            common, count = seen.most_common(1)[0]
            close = ", ".join(str(r.get("close", "-")) for r in results)
            print(name, scenario, f"{count}/{a.runs}", dict(seen), flush=True)
            lines.append(f"| {name} | {scenario} | {count}/{a.runs} | {close} | `{common}` |")
    stamp = f"Taken {datetime.date.today()} by `python benchmarks/studies/placement.py {' '.join(argv or sys.argv[1:])}`."
    write_section(a.out, "placement", [stamp, machine_line(), "", *lines])


if __name__ == "__main__":
    main()
