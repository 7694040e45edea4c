"""First-call time (capture + compile + first run) in a new process, cold and warm.

For each model: lort with an empty disk cache (cold) and again with the cache that run
filled (warm), and inductor likewise with its own cache directory. Each measurement is
a fresh Python process. Prints a table and writes it as the ``cold-warm`` section of
benchmarks/results/first_call.md.

    python -m benchmarks first-call [--models mlp,bert] [--scenarios infer1,train]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

CHILD = r"""
import sys, time, torch
from lort.testing.models import CASES, output_tensor, make_torchvision_importable
make_torchvision_importable()
name, scenario, backend = sys.argv[1:4]
batch = 1 if scenario == "infer1" else 8
model, args = CASES[name].make(batch, seed=0)
if scenario == "infer1":
    model.eval()
cm = torch.compile(model, backend=backend)
t0 = time.perf_counter()
if scenario == "infer1":
    with torch.no_grad():
        cm(*args)
else:
    output_tensor(cm(*args)).float().pow(2).mean().backward()
print(time.perf_counter() - t0)
"""


def first_call(name, scenario, backend, env):
    out = subprocess.run(
        [sys.executable, "-c", CHILD, name, scenario, backend], env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,cnn,transformer,bert,resnet18")
    ap.add_argument("--scenarios", default="infer1,train")
    ap.add_argument("--out", default=report.result_path("first_call.md"))
    a = ap.parse_args(argv)
    lines = [
        "| model | run | inductor cold s | inductor warm s | lort cold s | lort warm s | lort warm / cold | lort cold / inductor cold |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for name in a.models.split(","):
        for scenario in a.scenarios.split(","):
            times = {}
            for backend in ("inductor", "lort"):
                with tempfile.TemporaryDirectory() as d:
                    env = dict(os.environ, LORT_CACHE_DIR=d, LORT_DISK_CACHE="1", TORCHINDUCTOR_CACHE_DIR=d)
                    times[backend] = (first_call(name, scenario, backend, env), first_call(name, scenario, backend, env))
            (ic, iw), (lc, lw) = times["inductor"], times["lort"]
            line = f"| {name} | {scenario} | {ic:.2f} | {iw:.2f} | {lc:.2f} | {lw:.2f} | {lw / lc:.2f} | {lc / ic:.2f} |"
            lines.append(line)
            print(line, flush=True)
    # The file's other sections (readings by hand) stay.
    report.write_section(a.out, "cold-warm", [
        f"Taken {report.today()} by `{report.command('first-call', argv)}`: each figure is one fresh "
        "process's first call (capture + compile + first run), cold (empty cache directory) and warm (the "
        "directory the cold run filled: lort's disk cache, inductor's own cache).", report.machine_line(), "", *lines,
    ], title="# First call in a new process")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
