"""A decode step and a prompt's prefill, apart: lort int4 against ORT GenAI and llama.cpp.

``benchmarks/quantized_decoding.py`` divides a whole ``generate`` (prefill included) by its
new tokens. This study splits that time, per backend, on a Llama-style decoder of the
1.41B case's width (hidden 1536, 12 heads over 2 key/value heads, SwiGLU 8960, a
32000-token vocabulary) with fewer layers (``--layers``, default 8), random weights:

- **prefill+1**: the median ``generate`` of 1 new token after the 16-token prompt (the
  prompt's forward and one token);
- **decode step**: (the median ``generate`` of 33 new tokens - prefill+1) / 32.

Each backend runs in a fresh process (the peers load their own runtimes), 7 rounds of the
two generates interleaved after two warm-up generates; one process at a time.
Backends: ``lort_int4``, ``lort_int4_sym`` (``quantize="int4"``, ``executor="ort"``,
``quantize_symmetric`` False / True), ``lort_int4_sym_apart`` (the same with the products
of one activation as nodes of their own: compile/quantize.py's ``JOIN_PRODUCTS`` off),
``lort_int4_sym128``, ``ortgenai_int4_sym128`` (symmetric in blocks of 128), ``ortgenai_int4``, ``ortgenai_int4_sym``
(benchmarks/peer_ortgenai.py, asymmetric / symmetric), ``llamacpp_q4_0``
(benchmarks/peer_llamacpp.py). The peers need the environment ``make bench-peers`` builds:

    .venv-peers/bin/python benchmarks/studies/decode_split.py [--layers 8] [--backends lort_int4_sym,...] [--breakdown]

With ``--breakdown``, lort's rows also split a decode step (timers around ORT's own run,
lort's ``GroupSession.run`` and the compiled forward; the rest is transformers'
``generate`` loop). The lort rows run in lort's own environment too (``.venv/bin/python``).

Prints Markdown rows; the reading is in benchmarks/results/quantized_decoding.md
("Symmetric int4 against the peers' own setting").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
BACKENDS = ["lort_int4", "lort_int4_sym", "lort_int4_sym_apart", "lort_int4_sym128", "ortgenai_int4", "ortgenai_int4_sym",
            "ortgenai_int4_sym128", "llamacpp_q4_0"]

CHILD = r"""
import collections, json, statistics, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
from lort.testing.models import make_torchvision_importable
make_torchvision_importable()
import torch
layers, backend, breakdown = int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
block_size = 128 if backend.endswith("_sym128") else 32
from quantized_decoding import llama_decoder
model, ids = llama_decoder("llama_1.5b", layers)
cfg = model.config
work = tempfile.TemporaryDirectory(prefix="lort-split-")
spent = collections.Counter()  # seconds in each layer (lort's rows, --breakdown)
breakdown = breakdown and not backend.startswith(("llamacpp", "ortgenai"))
if backend.startswith("llamacpp"):
    import peer_llamacpp
    runner = peer_llamacpp.prepare(model, work.name, backend.split("_", 1)[1])
    gen = lambda n: runner.generate(ids, n)
elif backend.startswith("ortgenai"):
    import peer_ortgenai
    runner = peer_ortgenai.prepare(model, work.name, "int4", symmetric="_sym" in backend,
                                   block_size=block_size)
    gen = lambda n: runner.generate(ids, n)
else:
    import lort.runtime.binding as binding
    import lort.runtime.session as session

    def timer(fn, key):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t0
        return timed

    if breakdown:  # ORT's own run (the C++ call), lort's session run around it, the compiled forward
        init = binding.FastBinding.__init__

        def timed_init(self, *a, **k):
            init(self, *a, **k)
            self.run = timer(self.run, "ort")
        binding.FastBinding.__init__ = timed_init
        session.GroupSession.run = timer(session.GroupSession.run, "session")
    if backend.endswith("_apart"):  # the products of one activation as nodes of their own
        import lort.compile.quantize as quantize
        quantize.JOIN_PRODUCTS = False
    options = {"executor": "ort", "quantize": "int4", "quantize_symmetric": "_sym" in backend,
               "quantize_block_size": block_size}
    model.forward = torch.compile(model.forward, backend="lort", options=options)
    if breakdown:
        model.forward = timer(model.forward, "forward")

    def gen(n):
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
gen(1), gen(33), gen(33)
one, full = [], []
parts = {1: [], 33: []}
for _ in range(7):
    for n, into in ((1, one), (33, full)):
        spent.clear()
        t0 = time.perf_counter()
        gen(n)
        into.append(time.perf_counter() - t0)
        if breakdown:
            parts[n].append(dict(spent))
prefill, whole = statistics.median(one), statistics.median(full)
result = {"prefill": prefill, "step": (whole - prefill) / 32}
if breakdown:  # a decode step's share of each layer: (33 tokens - 1 token) / 32, medians
    for key in ("forward", "session", "ort"):
        result[key] = (statistics.median(p[key] for p in parts[33]) - statistics.median(p[key] for p in parts[1])) / 32
print("RESULT " + json.dumps(result))
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--breakdown", action="store_true",
                    help="lort's rows also split a decode step: ORT's run, lort's session around it, "
                         "Dynamo and AOTAutograd around lort's graph, transformers' generate loop")
    a = ap.parse_args(argv)
    backends = a.backends.split(",")
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        ap.error(f"unknown backends {unknown}; choose from {BACKENDS}")
    split = a.breakdown
    extra = " in ORT's run | lort's session around it | Dynamo, AOTAutograd, lort's graph | generate loop |"
    print(f"| backend ({a.layers} layers) | prefill+1 ms | decode step ms |" + (extra if split else ""))
    print("|---|---:|---:|" + ("---:|" * 4 if split else ""))
    for backend in backends:
        proc = subprocess.run([sys.executable, "-c", CHILD, BENCH, str(a.layers), backend, "1" if split else "0"],
                              capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(f"| {backend} | failed: {tail} | |")
            continue
        r = json.loads(lines[-1][len("RESULT "):])
        row = f"| {backend} | {r['prefill'] * 1e3:.1f} | {r['step'] * 1e3:.2f} |"
        if split and "ort" in r:
            row += (f" {r['ort'] * 1e3:.2f} | {(r['session'] - r['ort']) * 1e3:.2f} | "
                    f"{(r['forward'] - r['session']) * 1e3:.2f} | {(r['step'] - r['forward']) * 1e3:.2f} |")
        elif split:
            row += " - | - | - | - |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
