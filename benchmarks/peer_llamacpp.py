"""llama.cpp as a benchmark peer: greedy decoding of the SAME random-weight Hugging Face
model, its weights quantized by llama.cpp to Q4_0 or Q8_0 (llama-cpp-python 0.3.36).

1. The in-memory Llama / GPT-2 model is written straight to an F32 GGUF with
   ``gguf.GGUFWriter`` (PyPI gguf 0.19.0 = the gguf-py llama.cpp vendors), not with
   ``convert_hf_to_gguf.py`` (not installed by llama-cpp-python; it wants a real
   tokenizer). As that script does: llama q/k rows permuted to llama.cpp's RoPE layout,
   GPT-2 Conv1D weights transposed, a tied lm_head left out. Vocabulary: model "none" +
   ``<arch>.vocab_size`` dummy tokens, so an id means the same as in HF.
2. ``llama_cpp.llama_model_quantize`` with llama.cpp's recipe (as ``llama-quantize``):
   norms/biases stay F32, Q4_0 keeps the output matrix in Q6_K (``pure=True``: not), rows
   not a multiple of 32 long fall back to F16.
3. ``llama_cpp.Llama`` loads it (n_threads = os.cpu_count(), F16 KV cache, verbose=False);
   ``llama_decode`` on our own batch, argmax of the logits: no sampler, tokenizer or EOS.

    python benchmarks/peer_llamacpp.py   # self-check on a tiny Llama and a tiny GPT-2
"""

from __future__ import annotations

import ctypes
import logging
import os
import time

import numpy as np
import torch

log = logging.getLogger(__name__)
INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36 gguf==0.19.0'


def _require():
    try:
        import gguf
        import llama_cpp
    except ImportError as e:
        raise RuntimeError(f"the llama.cpp peer needs llama-cpp-python and gguf: `make bench-peers` installs the peers "
                           f"in .venv-peers and runs the quantized suites there (or {INSTALL}): {e}") from e
    quiet = logging.getLogger("llama-cpp-python")  # its callback prints llama.cpp's log to stderr
    if quiet.level == logging.NOTSET:
        quiet.setLevel(logging.ERROR)
    return llama_cpp, gguf


def _np(t):
    return t.detach().to(torch.float32).contiguous().numpy()


def _permute(w, n_head):  # HF rotate-half rows -> llama.cpp's interleaved RoPE rows
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: str) -> None:
    """The model's float32 weights and hyperparameters as an F32 GGUF at ``path``."""
    _, gguf = _require()
    c, arch, t = model.config, model.config.model_type, {}
    if arch == "llama":
        rope = getattr(c, "rope_parameters", None) or {}
        if c.attention_bias or c.mlp_bias or rope.get("rope_type", "default") != "default":
            raise NotImplementedError("Llama with biases or RoPE scaling")
        n_h, n_kv = c.num_attention_heads, c.num_key_value_heads
        hd = getattr(c, "head_dim", None) or c.hidden_size // n_h
        ints = {"context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
                "feed_forward_length": c.intermediate_size, "block_count": c.num_hidden_layers,
                "attention.head_count": n_h, "attention.head_count_kv": n_kv, "attention.key_length": hd,
                "attention.value_length": hd, "rope.dimension_count": hd}
        floats = {"rope.freq_base": rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)),
                  "attention.layer_norm_rms_epsilon": c.rms_norm_eps}
        m = model.model
        t["token_embd.weight"], t["output_norm.weight"] = _np(m.embed_tokens.weight), _np(m.norm.weight)
        for i, b in enumerate(m.layers):
            a, f, p = b.self_attn, b.mlp, f"blk.{i}."
            t[p + "attn_norm.weight"] = _np(b.input_layernorm.weight)
            t[p + "attn_q.weight"] = _permute(_np(a.q_proj.weight), n_h)
            t[p + "attn_k.weight"] = _permute(_np(a.k_proj.weight), n_kv)
            t[p + "attn_v.weight"], t[p + "attn_output.weight"] = _np(a.v_proj.weight), _np(a.o_proj.weight)
            t[p + "ffn_norm.weight"] = _np(b.post_attention_layernorm.weight)
            for hf, gg in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                t[p + gg + ".weight"] = _np(getattr(f, hf).weight)
    elif arch == "gpt2":
        if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh") or c.scale_attn_by_inverse_layer_idx:
            raise NotImplementedError("GPT-2 variant")
        ints = {"context_length": c.n_positions, "embedding_length": c.n_embd, "block_count": c.n_layer,
                "feed_forward_length": c.n_inner or 4 * c.n_embd, "attention.head_count": c.n_head}
        floats = {"attention.layer_norm_epsilon": c.layer_norm_epsilon}
        m = model.transformer
        t["token_embd.weight"], t["position_embd.weight"] = _np(m.wte.weight), _np(m.wpe.weight)
        names = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
                 "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
        for i, b in enumerate(m.h):
            for hf, gg in names.items():
                mod = b.get_submodule(hf)
                conv = type(mod).__name__ == "Conv1D"  # HF Conv1D keeps its weight as [in, out]
                t[f"blk.{i}.{gg}.weight"] = _np(mod.weight.T if conv else mod.weight)
                t[f"blk.{i}.{gg}.bias"] = _np(mod.bias)
        t["output_norm.weight"], t["output_norm.bias"] = _np(m.ln_f.weight), _np(m.ln_f.bias)
    else:
        raise NotImplementedError(f"no GGUF writer for model_type {arch!r}")
    out = model.get_output_embeddings()
    if out.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        t["output.weight"] = _np(out.weight)
    w = gguf.GGUFWriter(path, arch)
    for k, v in {**ints, "vocab_size": c.vocab_size}.items():
        w.add_uint32(f"{arch}.{k}", int(v))
    for k, v in floats.items():
        w.add_float32(f"{arch}.{k}", float(v))
    w.add_tokenizer_model("none")  # ids only: llama.cpp adds vocab_size dummy tokens
    w.add_file_type(0)  # LLAMA_FTYPE_ALL_F32
    for name, a in t.items():
        w.add_tensor(name, a)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()


class Runner:
    """One llama.cpp model and context; greedy decoding and prompt logits from ids."""

    def __init__(self, path: str, n_ctx: int = 512, **llama_kwargs):
        llama_cpp, _ = _require()
        self._lc, n, self.path, self.n_ctx = llama_cpp, os.cpu_count(), path, n_ctx
        kw = dict(n_ctx=n_ctx, n_batch=n_ctx, n_threads=n, n_threads_batch=n, verbose=False)
        self.llm = llama_cpp.Llama(model_path=path, **{**kw, **llama_kwargs})
        self.n_vocab = self.llm.n_vocab()
        self._batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)

    def _decode(self, ids, pos, all_logits=False):
        b, n = self._batch, len(ids)
        for i, tok in enumerate(ids):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = int(tok), pos + i, 1, all_logits or i == n - 1
            b.seq_id[i][0] = 0
        b.n_tokens = n
        rc = self._lc.llama_decode(self.llm.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = n if all_logits else 1
        flat = np.ctypeslib.as_array(self._lc.llama_get_logits(self.llm.ctx), shape=(rows * self.n_vocab,))
        return flat.reshape(rows, -1)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        self._lc.llama_memory_clear(self._lc.llama_get_memory(self.llm.ctx), True)
        return torch.from_numpy(self._decode(ids[0].tolist(), 0, all_logits=True).copy()).unsqueeze(0)

    def generate(self, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        out = ids[0].tolist()
        if len(out) + new_tokens > self.n_ctx:
            raise ValueError(f"{len(out)} + {new_tokens} tokens exceed n_ctx {self.n_ctx}")
        self._lc.llama_memory_clear(self._lc.llama_get_memory(self.llm.ctx), True)
        logits = self._decode(out, 0)
        for k in range(new_tokens):
            out.append(int(np.argmax(logits[0])))
            if k + 1 < new_tokens:
                logits = self._decode(out[-1:], len(out) - 1)
        return torch.tensor([out], dtype=torch.long)

    def close(self):
        if self._batch is not None:
            self._lc.llama_batch_free(self._batch)
            self._batch = None
            self.llm.close()


def prepare(model, workdir: str, quant: str, pure: bool = False, keep_f32: bool = False, **runner_kwargs) -> Runner:
    """Write ``model`` as GGUF under ``workdir``, quantized to ``quant`` ("q4_0", "q8_0", or
    "f32" for checks); a Runner on it. ``runner_kwargs`` go to Runner (n_ctx, Llama's)."""
    llama_cpp, _ = _require()
    ftypes = {"f32": llama_cpp.LLAMA_FTYPE_ALL_F32, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
              "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}
    if quant not in ftypes:
        raise ValueError(f"quant must be one of {sorted(ftypes)}, not {quant!r}")
    os.makedirs(workdir, exist_ok=True)
    path = src = os.path.join(workdir, "model-f32.gguf")
    t0 = time.perf_counter()
    write_gguf(model, src)
    t1 = time.perf_counter()
    if quant != "f32":
        path = os.path.join(workdir, f"model-{quant}{'-pure' if pure else ''}.gguf")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread, params.pure = ftypes[quant], os.cpu_count(), pure
        rc = llama_cpp.llama_model_quantize(src.encode(), path.encode(), ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize to {quant} returned {rc}")
        if not keep_f32:
            os.remove(src)
    log.info("GGUF %s: write %.2fs, quantize %.2fs, %.1f MiB", quant, t1 - t0, time.perf_counter() - t1,
             os.path.getsize(path) / 2**20)
    return Runner(path, **runner_kwargs)


if __name__ == "__main__":
    import tempfile

    from lort.testing.models import make_torchvision_importable
    make_torchvision_importable()  # transformers imports torchvision, whose ops may not load
    import transformers

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("gguf").setLevel(logging.WARNING)
    cfgs = [transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=512, hidden_size=256,
                                     intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                                     num_key_value_heads=4),  # 688 (not a multiple of 32) would fall back to F16
            transformers.GPT2Config(n_embd=256, n_layer=4, n_head=8)]
    for cfg in cfgs:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ref = model(ids).logits
            want = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
        for quant in ("f32", "q8_0", "q4_0"):
            with tempfile.TemporaryDirectory() as d:
                t0 = time.perf_counter()
                r = prepare(model, d, quant)
                prep, err = time.perf_counter() - t0, float((r.logits(ids) - ref).norm() / ref.norm())
                same = float((r.generate(ids, 32)[0, 16:] == want[0, 16:]).float().mean())
                print(f"{cfg.model_type} {quant}: logits rel. error {err:.2e}, same tokens {same:.3f}, "
                      f"prepare {prep:.2f}s")
                r.close()
