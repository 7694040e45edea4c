"""A peer backend for the decoding benchmarks: ONNX Runtime GenAI (onnxruntime-genai 0.18.0).

The path, from the same random-weight Hugging Face model as the other rows:

1. ``model.save_pretrained(workdir/hf)``, beside a local word-level tokenizer
   (``t0`` .. ``t{vocab-1}``, built with ``tokenizers``, nothing downloaded): the builder
   insists on loading a tokenizer (``AutoTokenizer.from_pretrained``) and copies it to
   its output; decoding here feeds token ids and never uses it.
2. ORT GenAI's own model builder, ``python -m onnxruntime_genai.models.builder -i hf -o
   <precision> -p <precision> -e cpu -c cache --extra_options ...``, run in a child
   process (the builder appends its folder to ``sys.path``, importing top-level modules
   named ``builders`` and ``quantization``, and holds its own copy of the weights; a child
   keeps both out of the benchmark's process). The child first makes PyPI's CUDA
   torchvision importable beside CPU torch (lort.testing.models), without which the
   builder's ``from transformers import ...`` fails. int4/int8 use the options of lort's
   own int4/int8 rows (Options.quantize defaults): ``block_size=32 accuracy_level=4
   is_symmetric=false`` (blocks of 32, int8 compute, asymmetric with zero points), or
   ``is_symmetric=true`` with ``symmetric`` (no zero points, the builder's default), and
   ``block_size`` from ``prepare``'s argument (64 for the ``_sym64`` rows); every
   MatMul (attention, MLP and lm_head) becomes MatMulNBits, the embedding stays float32.
   ``hf_token=false``, and ``HF_HUB_OFFLINE=1`` in the child: nothing is fetched.
   ``build_seconds`` is the builder's own wall time (its ``main``), the child's start and
   imports excluded; ``build_total_seconds`` includes them.
3. ``genai_config.json``'s decoder session options get ``intra_op_num_threads`` =
   ``torch.get_num_threads()`` (the builder writes none), so ORT uses eager's threads.
4. Decoding: ``og.Generator`` with ``do_sample=False`` and ``min_length = max_length =
   T + new_tokens`` (EOS cannot end it early), the prompt's ids appended directly.
   ``logits`` reads the ``logits`` output after the prompt is appended: all T positions
   (the builder's ``prune_lm_head`` is off by default).

GPT-2 (GPT2LMHeadModel) is not among the builder's architectures: ``prepare`` raises
RuntimeError for it, as for any architecture the builder rejects.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import torch

logger = logging.getLogger(__name__)

PRECISIONS = ("fp32", "int8", "int4")
#: lort's Options.quantize defaults: blocks of 32, int8 compute (the builder's own
#: default is symmetric: ``prepare(..., symmetric=True)``).
QUANT_OPTIONS = ("accuracy_level=4",)

_CHILD = r"""
import sys, time
from lort.testing.models import make_torchvision_importable
make_torchvision_importable()
import runpy
import onnxruntime_genai.models.builder  # noqa: F401  (the imports, outside the timing)
sys.argv = ["builder"] + sys.argv[1:]
t0 = time.perf_counter()
runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")
print("BUILD_SECONDS", time.perf_counter() - t0)
"""


def _import_og():
    try:
        import onnxruntime_genai as og
    except ImportError as e:
        raise RuntimeError("onnxruntime_genai is not installed: `make bench-peers` installs the peers in .venv-peers "
                           "and runs the quantized suites there (or pip install onnxruntime-genai==0.18.0; it needs "
                           f"onnxruntime>=1.31.0) ({e})") from e
    return og


def _save_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer over ``t0`` .. ``t{vocab_size-1}``; built here, not downloaded."""
    import tokenizers
    import transformers

    model = tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")
    fast.save_pretrained(path)


class Runner:
    """Greedy decoding of one built model with onnxruntime_genai on CPU."""

    def __init__(self, path: str, vocab_size: int, build_seconds: float, build_total_seconds: float):
        og = _import_og()
        self._og, self.path, self.vocab_size = og, path, vocab_size
        self.build_seconds, self.build_total_seconds = build_seconds, build_total_seconds
        config = og.Config(path)
        config.clear_providers()  # CPU
        self.model = og.Model(config)

    def _generator(self, ids: torch.Tensor, length: int):
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(f"ids must be [1, T], got {tuple(ids.shape)}")
        params = self._og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=length, min_length=length, batch_size=1)
        gen = self._og.Generator(self.model, params)
        gen.append_tokens(ids.to(torch.int32).numpy())
        return gen

    def generate(self, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        total = ids.shape[1] + new_tokens
        gen = self._generator(ids, total)
        while not gen.is_done():
            gen.generate_next_token()
        seq = torch.from_numpy(gen.get_sequence(0).astype("int64"))[None]
        if seq.shape[1] != total:
            raise RuntimeError(f"onnxruntime_genai returned {seq.shape[1]} tokens, expected {total}")
        return seq

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        gen = self._generator(ids, ids.shape[1] + 1)
        out = torch.from_numpy(gen.get_output("logits")).float()
        return out.reshape(1, ids.shape[1], self.vocab_size)


def _set_threads(path: str, threads: int) -> None:
    cfg_path = os.path.join(path, "genai_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=4)


def prepare(model, workdir: str, precision: str, symmetric: bool = False, block_size: int = 32) -> Runner:
    """Save ``model`` under ``workdir``, build it with ORT GenAI's builder at ``precision``
    (fp32, int8 or int4; CPU; quantized with zero points as lort's default, or without
    where ``symmetric``; in blocks of ``block_size``), and return a Runner over the built
    model."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    _import_og()
    arch = type(model).__name__
    hf_dir, out_dir = os.path.join(workdir, "hf"), os.path.join(workdir, precision)
    model.save_pretrained(hf_dir)
    _save_tokenizer(hf_dir, model.config.vocab_size)
    cmd = [sys.executable, "-c", _CHILD, "-i", hf_dir, "-o", out_dir, "-p", precision, "-e", "cpu",
           "-c", os.path.join(workdir, "cache"), "--extra_options", "hf_token=false"]
    if precision != "fp32":
        cmd += QUANT_OPTIONS + (f"block_size={block_size}", f"is_symmetric={'true' if symmetric else 'false'}")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    logger.info("building %s %s: %s", arch, precision, " ".join(cmd[3:]))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    total = time.perf_counter() - t0
    logger.debug("builder stdout:\n%s\nbuilder stderr:\n%s", proc.stdout, proc.stderr[-20000:])
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        if "is not currently supported" in proc.stderr:
            raise RuntimeError(f"ORT GenAI's model builder does not support {arch} "
                               f"(config.architectures={model.config.architectures}): {tail[0]}")
        raise RuntimeError(f"ORT GenAI's model builder failed for {arch} {precision} "
                           f"(exit {proc.returncode}): {tail[0]}")
    seconds = [float(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("BUILD_SECONDS")]
    build_seconds = seconds[-1] if seconds else total
    _set_threads(out_dir, torch.get_num_threads())
    logger.info("built %s %s in %.1f s (%.1f s with the child's start)", arch, precision, build_seconds, total)
    return Runner(out_dir, model.config.vocab_size, build_seconds, total)


if __name__ == "__main__":
    import tempfile

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from lort.testing.models import make_torchvision_importable

    make_torchvision_importable()
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=512, hidden_size=256,
                                   intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=4)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want_logits = hf(ids).logits
    want = hf.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    with tempfile.TemporaryDirectory() as tmp:
        for prec in PRECISIONS:
            runner = prepare(hf, os.path.join(tmp, prec), prec)
            err = ((runner.logits(ids) - want_logits).norm() / want_logits.norm()).item()
            got = runner.generate(ids, 32)
            same = (got[0, 16:] == want[0, 16:]).float().mean().item()
            logger.info("%s: build %.2f s, logits rel. error %.2e, same tokens %.0f%%",
                        prec, runner.build_seconds, err, 100 * same)
            assert got.shape == want.shape and torch.equal(got[:, :16], ids)
            if prec == "fp32":
                assert err < 1e-4 and same == 1.0, (err, same)
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2)).eval()
        try:
            prepare(gpt2, os.path.join(tmp, "gpt2"), "fp32")
            logger.info("gpt2: built")
        except RuntimeError as e:
            logger.info("gpt2: %s", e)
