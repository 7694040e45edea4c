"""Greedy decoding with quantized weights (Options.quantize, issue 45): ms per token,
first generate, resident memory and the quantization's error, for eager float32, lort
float32 and lort with int8 and int4 weights.

Cases (random weights from transformers configs, batch 1, a 16-token prompt,
``max_new_tokens=32``, greedy): ``llama_0.5b`` (a Llama-style decoder: hidden 1024, 24
layers, 16 heads with 4 key/value heads, SwiGLU 4864, a 32000-token vocabulary) and
``llama_1.5b`` (hidden 1536, 28 layers, 12 heads with 2 key/value heads, SwiGLU 8960),
``gpt2_medium`` (GPT2Config(n_embd=1024, n_layer=24, n_head=16), 355M).

Each (case, backend) runs in a fresh process with an empty lort cache. It builds the
model, generates once in eager float32 (the reference tokens, and the prompt's logits),
then:

- ``lort``, ``lort_int8``, ``lort_int4``: a copy of the model whose ``forward`` is
  ``torch.compile(forward, backend="lort", options=...)`` (``executor="ort"``;
  ``quantize`` for int8/int4, its other settings at their defaults: blocks of 32,
  asymmetric, int8 compute); ``lort_int8_offload``, ``lort_int4_offload`` with
  ``quantize_offload_dir`` too (a temporary directory under /var/tmp); ``_sym`` after the
  bit width (``lort_int4_sym``, ``lort_int4_sym_offload``): ``quantize_symmetric=True``
  (no zero points: llama.cpp's Q4_0 / Q8_0 and ORT GenAI's builder default); ``_sym64``
  (``lort_int4_sym64``, ``lort_int4_sym64_offload``): symmetric in blocks of 64, 4.5 bits
  a weight with float32 scales, as llama.cpp's Q4_0 (blocks of 32, float16 scales);
  ``_sym128`` (``lort_int4_sym128``, ``lort_int4_sym128_offload``): in blocks of 128,
  onnxruntime's quantizer's and torchao's default (4.25 bits a weight);
- ``torchao_int8``, ``torchao_int4`` (PyTorch's way): torchao's ``quantize_`` with
  ``Int8WeightOnlyConfig()`` or, for CPU int4, ``PrototypeInt4WeightOnlyConfig(group_size=32)``
  (``_weight_int4pack_mm_for_cpu``), then ``torch.compile(model.forward)`` (inductor);
  float32 activations, as every other row;
- ``ortgenai_int8``, ``ortgenai_int4``: ORT GenAI's model builder on the checkpoint
  saved locally, with lort's quantization settings (benchmarks/peer_ortgenai.py;
  Llama only: its builder has no GPT-2); ``ortgenai_int8_sym``, ``ortgenai_int4_sym``:
  symmetric, its builder's default; ``ortgenai_int4_sym64``, ``ortgenai_int4_sym128``:
  symmetric in blocks of 64 or 128;
- ``llamacpp_q8_0``, ``llamacpp_q4_0``: llama.cpp through llama-cpp-python, a GGUF
  converted from the same checkpoint and quantized to Q8_0 / Q4_0
  (benchmarks/peer_llamacpp.py).

The peers need ``make bench-peers`` (it installs them in a virtual environment of their own,
.venv-peers: torchao, once installed, warns in every process that imports transformers).
Every process also times eager float32's generate, interleaved with its backend's (a 2-core
VM's speed drifts by 20% between processes, not within one), so it holds the float32 model
throughout, and every other backend runs its own copy or build; eager's model leaves the
process before RSS is read (each backend's RSS is its own, lort's with its copy of the
module; the peak is not).

- **first s**: the first generate, compiles included (for ORT GenAI and llama.cpp: the
  build or conversion from the saved checkpoint, then the first generate);
- **ms / token**: the median of ``--repeats`` later generates, divided by the new tokens
  (prefill included); **vs eager**: eager's ms / token in the same process divided by
  this backend's;
- **RSS MiB**: resident memory after the timed generates, and its peak (VmHWM) over the
  whole process; **PSS MiB**: the same memory with each page counted once however many
  mappings of the process share it (lort's sessions map one file of pre-packed weights,
  runtime/prepacked.py);
- **logits rel. error**: ||logits - eager's|| / ||eager's|| over the prompt's forward;
- **same tokens**: the share of the 32 greedy tokens equal to eager float32's. Random
  weights give nearly flat logits, so greedy tokens flip at small errors: this figure is
  harsher here than on a trained model.

    python -m benchmarks quantized-decoding [--cases llama_0.5b,llama_1.5b,gpt2_medium]
        [--backends eager,lort,lort_int8,lort_int4,torchao_int4,ortgenai_int4,llamacpp_q4_0,...]

Writes the ``quantized-decoding`` section of benchmarks/results/quantized_decoding.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402
from scale import grid_arguments, grid_choices, run_grid  # noqa: E402

BACKENDS = ["eager", "lort", "lort_int8", "lort_int4", "lort_int8_offload", "lort_int4_offload", "lort_int8_sym",
            "lort_int4_sym", "lort_int8_sym_offload", "lort_int4_sym_offload", "lort_int4_sym64",
            "lort_int4_sym64_offload", "lort_int4_sym128", "lort_int4_sym128_offload", "torchao_int8", "torchao_int4",
            "ortgenai_int8", "ortgenai_int4", "ortgenai_int8_sym", "ortgenai_int4_sym", "ortgenai_int4_sym64",
            "ortgenai_int4_sym128", "llamacpp_q8_0",
            "llamacpp_q4_0"]
CASES = ["llama_0.5b", "llama_1.5b", "gpt2_medium"]
#: The Llama-style cases' sizes (a 32000-token vocabulary each; the studies of
#: benchmarks/studies/decode_*.py take llama_1.5b's width with fewer layers).
LLAMA_SIZES = {"llama_0.5b": dict(hidden_size=1024, intermediate_size=4864, num_hidden_layers=24,
                                  num_attention_heads=16, num_key_value_heads=4),
               "llama_1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                  num_attention_heads=12, num_key_value_heads=2)}


def llama_decoder(case: str, layers: int | None = None):
    """``case``'s LlamaForCausalLM with random weights (seed 0), in eval mode, with
    ``layers`` layers where given instead of the case's, and its 16-token prompt (seed 1)."""
    import torch
    import transformers

    size = dict(LLAMA_SIZES[case], **({} if layers is None else {"num_hidden_layers": layers}))
    cfg = transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=512, **size)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model, torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))


CHILD = r"""
import json, re, statistics, sys, time
import torch
sys.path.insert(0, sys.argv[1])
import rss
from lort.testing.models import make_torchvision_importable
make_torchvision_importable()
import transformers, lort

case, backend, repeats, new = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
block = re.search(r"_sym(\d+)", backend)  # _sym64, _sym128: symmetric in blocks of that size, else 32
block_size = int(block.group(1)) if block else 32
if case == "gpt2_medium":
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=1024, n_layer=24, n_head=16)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
else:
    from quantized_decoding import llama_decoder
    model, ids = llama_decoder(case)
kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
with torch.no_grad():
    want_logits = model(ids).logits
want = model.generate(ids, **kw)
params = sum(p.numel() for p in model.parameters())


def eager_generate():
    return model.generate(ids, **kw)


t0 = time.perf_counter()
if backend.startswith(("ortgenai", "llamacpp")):  # a peer runtime, from the checkpoint saved locally
    import importlib, tempfile
    kind, scheme = backend.split("_", 1)
    work = tempfile.TemporaryDirectory(prefix="lort-peer-")  # removed at exit
    if kind == "ortgenai":  # int4 / int4_sym ...: the precision, and symmetric or lort's asymmetric default
        scheme, _, sym = scheme.partition("_")
        runner = importlib.import_module("peer_ortgenai").prepare(model, work.name, scheme, symmetric=sym.startswith("sym"),
                                                                  block_size=block_size)
    else:
        runner = importlib.import_module("peer_" + kind).prepare(model, work.name, scheme)
    generate = lambda: runner.generate(ids, new)
    prompt_logits = lambda: runner.logits(ids)
else:
    if backend.startswith("torchao"):  # PyTorch's way: torchao's weight-only configs, inductor
        import copy
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
        run = copy.deepcopy(model)  # quantize_ works in place; eager's model stays for the timing
        quantize_(run, PrototypeInt4WeightOnlyConfig(group_size=32) if backend.endswith("int4")
                  else Int8WeightOnlyConfig())
        run.forward = torch.compile(run.forward)
        generate = lambda: run.generate(ids, **kw)
    elif backend == "eager":
        run = model
        generate = eager_generate
    else:  # lort's own copy of the model: eager's generate does not read (page in) its weights
        import copy, tempfile
        run = copy.deepcopy(model)
        options = {"executor": "ort"}
        if backend != "lort":
            options["quantize"] = backend.split("_")[1]
        if "_sym" in backend:
            options["quantize_symmetric"] = True
        if block:
            options["quantize_block_size"] = block_size
        if backend.endswith("_offload"):
            offload_dir = tempfile.TemporaryDirectory(prefix="lort-offload-", dir="/var/tmp")  # a disk, not tmpfs
            options["quantize_offload_dir"] = offload_dir.name
        run.forward = torch.compile(run.forward, backend="lort", options=options)
        generate = lambda: run.generate(ids, **kw)

    def prompt_logits():
        with torch.no_grad():
            return run(ids).logits
got = generate()
first = time.perf_counter() - t0
times, eager_times = [], []
for _ in range(repeats):  # interleaved with eager float32 in this process: a VM's speed drifts between processes
    for fn, into in ((generate, times), (eager_generate, eager_times)):
        t0 = time.perf_counter()
        out = fn()
        into.append(time.perf_counter() - t0)
        if fn is generate:
            got = out
if backend != "eager":
    import gc
    del model, eager_generate
    gc.collect()  # their own footprint: the float32 model leaves the process
s = rss.status()  # after the timed generates, as the table says: before the prompt's forward below
logits = prompt_logits()
rel = ((logits - want_logits).norm() / want_logits.norm()).item()
same = (got[0, ids.shape[1]:] == want[0, ids.shape[1]:]).float().mean().item()
per_token, eager_per_token = statistics.median(times) / new, statistics.median(eager_times) / new
print(json.dumps({"first": first, "per_token": per_token, "vs_eager": eager_per_token / per_token,
                  "rss": s["VmRSS"], "pss": s.get("Pss"), "peak": s["VmHWM"], "rel": rel, "same": same, "params": params}))
"""


def table(results: dict) -> list[str]:
    def heading(case, by_backend):
        params = next((r["params"] for r in by_backend.values() if "params" in r), 0)
        return f"### {case} ({params / 1e9:.2f}B parameters)"

    def row(b, r, by_backend):
        e = by_backend.get("eager", {})
        vs = f"{r['vs_eager']:.2f}x"
        mem = f"{r['rss'] / e['rss']:.2f}x" if "rss" in e else "-"
        pss = f"{r['pss'] / 2**20:.0f}" if r.get("pss") else "-"
        return (f"| {b} | {r['first']:.1f} | {r['per_token'] * 1e3:.1f} | {vs} | {r['rss'] / 2**20:.0f} "
                f"| {pss} | {r['peak'] / 2**20:.0f} | {mem} | {r['rel']:.2e} | {r['same'] * 100:.0f}% |")

    return report.case_tables(
        results, heading,
        "| backend | first s | ms / token | vs eager | RSS MiB | PSS MiB | peak RSS MiB | RSS vs eager "
        "| logits rel. error | same tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|", row)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    grid_arguments(ap, CASES, BACKENDS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=report.result_path("quantized_decoding.md"))
    a = ap.parse_args(argv)
    results = run_grid(CHILD, *grid_choices(ap, a, CASES, BACKENDS), str(a.repeats), str(a.new_tokens))
    stamp = f"Taken {datetime.date.today()} by `{report.command('quantized-decoding', argv)}`."
    report.write_section(a.out, "quantized-decoding", [stamp, report.machine_line(), report.peers_line(("torchao", "onnxruntime-genai", "llama-cpp-python", "gguf")), "",
                                                    *table(results)],
                         title="# Quantized decoding (Options.quantize)")


if __name__ == "__main__":
    main()
