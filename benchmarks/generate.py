"""Greedy generation through each front end: first generate, steady ms per new token,
captures, ORT runs, and whether the tokens are eager's.

Cases (random weights from transformers configs, batch 1, a 16-token prompt,
``max_new_tokens=32``, greedy): ``gpt2_small`` (GPT2LMHeadModel(GPT2Config()), 124M)
and ``llama_small`` (a Llama-style decoder: hidden 1024, 8 layers, 16 heads with 4
key/value heads, SwiGLU 2816, a 32000-token vocabulary; 0.16B parameters).

Each (case, backend) runs in a fresh process with empty lort and inductor caches. It
builds the model, generates once in eager (the reference tokens), then:

- **eager**: ``model.generate``;
- **inductor** / **lort**: ``model.forward = torch.compile(model.forward, backend=...)``
  (``torch.compile(model).generate`` would call the uncompiled forward: generate is a
  method of the module), then ``model.generate``;
- **ortmodule**: ``lort.ORTModule(model).generate`` (the model's methods are bound to the
  wrapper, so generate's ``self(...)`` runs through it).

**first s** is the first generate (compiles included); **ms/token** the median over
``--repeats`` later generates of their time divided by the new tokens (prefill included);
each of those alternates with an eager generate in the same process (the model's own
forward; the order flipped every round): **tokens/s vs eager (interleaved)** is the
median over rounds of eager's time / the backend's, the figure to read on a noisy VM;
**vs eager's process** divides the eager process's ms/token by this one's;
**captures**: Dynamo's compiled frames (inductor, lort) or ORTModule's captures;
**ORT runs**: ORT session runs during one steady generate; **same tokens**: every
generate's tokens equal eager's.

    python -m benchmarks generation [--cases gpt2_small,llama_small] [--backends eager,inductor,lort,ortmodule]

Writes the ``generate`` section of benchmarks/results/generation.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402
from scale import run_grid  # noqa: E402

BACKENDS = ["eager", "inductor", "lort", "ortmodule"]
CASES = ["gpt2_small", "llama_small"]

CHILD = r"""
import json, statistics, sys, time
import torch
from lort.testing.models import make_torchvision_importable
make_torchvision_importable()
import transformers, lort, torch._dynamo
from torch._dynamo.utils import counters

case, backend, repeats, new = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0)
if case == "gpt2_small":
    cfg = transformers.GPT2Config()
    model = transformers.GPT2LMHeadModel(cfg)
else:
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(cfg)
model.eval()
ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
want = model.generate(ids, **kw)
runner = model
eager_forward = model.forward
if backend in ("inductor", "lort"):
    model.forward = torch.compile(model.forward, backend="inductor" if backend == "inductor" else "lort")
elif backend == "ortmodule":
    runner = lort.ORTModule(model)
compiled_forward = model.forward
same = True
t0 = time.perf_counter()
got = runner.generate(ids, **kw)
first = time.perf_counter() - t0
same &= torch.equal(got, want)


def eager_generate():
    # The model's own forward (torch.compile replaced it on the model; ORTModule did not).
    if backend not in ("inductor", "lort"):
        return model.generate(ids, **kw)
    model.forward = eager_forward
    try:
        return model.generate(ids, **kw)
    finally:
        model.forward = compiled_forward


times, eager_times, ratios = [], [], []
for i in range(repeats):
    order = ("backend", "eager") if i % 2 else ("eager", "backend")
    for which in order:
        runs = lort.stats.ort_runs
        t0 = time.perf_counter()
        got = runner.generate(ids, **kw) if which == "backend" else eager_generate()
        (times if which == "backend" else eager_times).append(time.perf_counter() - t0)
        if which == "backend":
            runs = lort.stats.ort_runs - runs
            backend_runs = runs
        same &= torch.equal(got, want)
    ratios.append(eager_times[-1] / times[-1])
runs = backend_runs
if backend == "ortmodule":
    captures = len(runner.transition_manager.captures)
else:
    captures = counters["stats"]["unique_graphs"]
print(json.dumps({"first": first, "per_token": statistics.median(times) / new, "captures": captures,
                  "eager_per_token": statistics.median(eager_times) / new, "vs_eager": statistics.median(ratios),
                  "ort_runs": runs, "same": bool(same), "params": sum(p.numel() for p in model.parameters())}))
"""


def table(results: dict) -> list[str]:
    def heading(case, by_backend):
        params = next((r["params"] for r in by_backend.values() if "params" in r), 0)
        return f"### {case} ({params / 1e6:.0f}M parameters)"

    def row(b, r, by_backend):
        e = by_backend.get("eager", {})
        vs = f"{e['per_token'] / r['per_token']:.2f}x" if "per_token" in e else "-"
        return (f"| {b} | {r['first']:.1f} | {r['per_token'] * 1e3:.1f} | {r['eager_per_token'] * 1e3:.1f} "
                f"| {r['vs_eager']:.2f}x | {vs} | {r['captures']} "
                f"| {r['ort_runs']} | {'yes' if r['same'] else 'NO'} |")

    return report.case_tables(
        results, heading,
        "| backend | first s | ms / token | eager's ms / token, same process | tokens/s vs eager (interleaved) "
        "| vs eager's process | captures | ORT runs per generate | same tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|", row)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=report.result_path("generation.md"))
    a = ap.parse_args(argv)
    results = run_grid(CHILD, a.cases.split(","), a.backends.split(","), str(a.repeats), str(a.new_tokens))
    stamp = f"Taken {datetime.date.today()} by `{report.command('generation', argv)}`."
    report.write_section(a.out, "generate", [stamp, report.machine_line(), "", *table(results)])


if __name__ == "__main__":
    main()
