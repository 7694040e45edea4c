"""One decode step's ONNX model, lort's against ORT GenAI's, replayed in one ORT process.

benchmarks/results/quantized_decoding.md found ORT GenAI's int4 decode step ahead of
lort's (1.11-1.24x on AMD EPYCs) with most of the lead inside ORT, but could not say
where: ORT's profiler changes the order of the two when each runs in its own process.
This study runs both graphs in one process, on one onnxruntime, with the same threads:

1. the 1.41B case's width (hidden 1536, 12 heads over 2 key/value heads, SwiGLU 8960,
   32000 tokens) with ``--layers`` layers and random weights;
2. ORT GenAI's model builder makes its int4 model (symmetric, blocks of 32, int8
   compute: benchmarks/peer_ortgenai.py); lort compiles the same module with
   ``quantize="int4"``, ``quantize_symmetric=True``, ``executor="ort"`` and decodes 32
   tokens after a 16-token prompt; the decode step's session (lort's ``GroupSession``
   run most often) and its last inputs are kept;
3. ORT GenAI's ``model.onnx`` is loaded into a plain ``onnxruntime.InferenceSession``
   with its ``genai_config.json`` session options and the same thread count, and fed a
   decode step at the same past length as lort's kept inputs (random caches, one token;
   each layer's past and present bound to one buffer of the generate's length, as ORT
   GenAI's ``past_present_share_buffer`` runs them);
4. ``--rounds`` rounds, each running lort's session then GenAI's ``--runs`` times (the
   order swapped every round); the medians of each run's wall clock. lort's session is
   run through ``GroupSession.run`` (its binding included, about 0.2-0.5 ms at 28 layers);
   GenAI's through an IOBinding with the inputs bound once and the outputs ORT allocates;
5. with ``--profile``, a second process does the same with ORT's profiler on in both
   sessions, and sums each op type's kernel time per run (the profiler's own cost is in
   every figure, alike for both).

Both models' op-type counts are printed too, each as ORT optimized it. With
``--products``, instead, a model of the layers' products alone with q/k/v and gate/up apart
(lort's graph) or joined (ORT GenAI's), timed interleaved (``joined_products``). Needs
onnxruntime-genai (``make bench-peers``'s environment) except with ``--products``:

    .venv-peers/bin/python benchmarks/studies/decode_replay.py [--layers 28] [--rounds 15] [--runs 5] [--profile]
    python benchmarks/studies/decode_replay.py --products [--layers 28]

Prints Markdown; the reading is in benchmarks/results/quantized_decoding.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)

CHILD = r"""
import collections, json, os, statistics, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
from lort.testing.models import make_torchvision_importable
make_torchvision_importable()
import numpy as np
import onnx
import onnxruntime as ort
import torch
layers, rounds, runs, profile = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
work = tempfile.TemporaryDirectory(prefix="lort-replay-")
from quantized_decoding import llama_decoder
model, ids = llama_decoder("llama_1.5b", layers)
cfg = model.config
import peer_ortgenai
built = peer_ortgenai.prepare(model, work.name, "int4", symmetric=True)
genai_dir = built.path
del built

import lort.runtime.session as session
if profile:  # every lort session profiles itself
    make = session.session_options
    def profiled(*a, **k):
        so = make(*a, **k)
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(work.name, "lort")
        return so
    session.session_options = profiled
made = {}  # session name -> what built it (lort's graph as ORT optimizes it is written from it)
create = session.create_session
def recorded(model, device, options, name, threads, *a, **k):
    made[name] = (model, device, options, threads)
    return create(model, device, options, name, threads, *a, **k)
session.create_session = recorded
seen = collections.Counter()
kept = {}
run = session.GroupSession.run
def recording(self, args):
    seen[id(self)] += 1
    kept[id(self)] = (self, [a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    return run(self, args)
session.GroupSession.run = recording
options = {"executor": "ort", "quantize": "int4", "quantize_symmetric": True}
model.forward = torch.compile(model.forward, backend="lort", options=options)
with torch.no_grad():
    model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
session.GroupSession.run = run
decode, args = kept[seen.most_common(1)[0][0]]
past = max(a.shape[2] for a in args if isinstance(a, torch.Tensor) and a.dim() == 4)

with open(os.path.join(genai_dir, "genai_config.json"), encoding="utf-8") as f:
    full = json.load(f)
gcfg = full["model"]["decoder"]
# ORT GenAI's own runs share each layer's past and present buffer (past_present_share_buffer):
# caches of the generate's whole length, appended in place.
share = full["search"].get("past_present_share_buffer")
so = ort.SessionOptions()
for key, value in gcfg.get("session_options", {}).items():
    if key == "inter_op_num_threads":
        so.inter_op_num_threads = int(value)
    elif isinstance(value, str) and key != "log_id":
        so.add_session_config_entry(key, value)
so.intra_op_num_threads = torch.get_num_threads()  # what peer_ortgenai writes into its config
if profile:
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(work.name, "genai")
genai = ort.InferenceSession(os.path.join(genai_dir, gcfg["filename"]), so, providers=["CPUExecutionProvider"])

def dim(d):
    if isinstance(d, int):
        return d
    d = str(d).lower()
    if "batch" in d:
        return 1
    if "head" in d or "kv_cache_dim" in d:
        return cfg.hidden_size // cfg.num_attention_heads
    if "total" in d:
        return past + 1
    if "past" in d:  # a shared buffer holds the whole generate (16 + 33 tokens)
        return max(past + 1, 49) if share else past
    return 1
rng = np.random.default_rng(0)
binding = genai.io_binding()
feeds = {}
for i in genai.get_inputs():
    shape = [dim(d) for d in i.shape]
    if i.name == "input_ids":
        value = rng.integers(0, cfg.vocab_size, shape).astype(np.int64)
    elif i.name == "attention_mask":
        value = np.ones(shape, np.int64)
    elif i.name == "position_ids":
        value = np.full(shape, past, np.int64)
    elif i.type == "tensor(float)":
        value = rng.standard_normal(shape).astype(np.float32)
    else:
        raise SystemExit(f"GenAI input {i.name} {i.type} {i.shape}: no feed for it")
    feeds[i.name] = value
    binding.bind_cpu_input(i.name, value)
for o in genai.get_outputs():
    if share and o.name.startswith("present"):
        past_name = o.name.replace("present", "past_key_values")
        buf = feeds[past_name]
        binding.bind_output(o.name, "cpu", 0, np.float32, list(buf.shape), buf.ctypes.data)
    else:
        binding.bind_output(o.name)
def run_genai():
    genai.run_with_iobinding(binding)
def run_lort():
    decode.run(args)
# lort's ORT run alone: its binding as the last GroupSession.run left it, run again
# (its outputs written into the tensors that run returned, held here).
held = decode.run(args)
def run_lort_ort():
    decode._binding.run(decode._run_options)
for fn in (run_lort, run_lort_ort, run_genai) * 3:
    fn()
times = {"lort": [], "lort_ort": [], "genai": []}
for r in range(rounds):
    order = (("lort", run_lort), ("lort_ort", run_lort_ort), ("genai", run_genai))
    for name, fn in (order if r % 2 == 0 else order[::-1]):
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)

def counts(m):
    return collections.Counter(f"{n.domain}:{n.op_type}" if n.domain else n.op_type for n in m.graph.node)
opt = os.path.join(work.name, "genai_opt.onnx")
so2 = ort.SessionOptions()
so2.optimized_model_filepath = opt
so2.add_session_config_entry("session.optimized_model_external_initializers_file_name", "genai_opt.onnx.data")
so2.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
ort.InferenceSession(os.path.join(genai_dir, gcfg["filename"]), so2, providers=["CPUExecutionProvider"])
result = {"past": past, "lort_ms": statistics.median(times["lort"]) * 1e3,
          "genai_ms": statistics.median(times["genai"]) * 1e3,
          "lort_ort_ms": statistics.median(times["lort_ort"]) * 1e3,
          "genai_ops": counts(onnx.load(opt, load_external_data=False)),
          "session_options": gcfg.get("session_options", {}),
          "share": share, "genai_inputs": sorted({f"{i.name.split('.')[0]} {i.shape}" for i in genai.get_inputs()})}
mdl, device, opts, threads = made[decode.name]
session.save_optimized(mdl, os.path.join(work.name, "lort_opt.onnx"), device, opts, threads)
result["lort_ops"] = counts(onnx.load(os.path.join(work.name, "lort_opt.onnx"), load_external_data=False))
if profile:
    spent = {}
    for who, sess in (("lort", decode.session), ("genai", genai)):
        path = sess.end_profiling()
        events = json.load(open(path))
        nruns = sum(1 for e in events if e.get("name") == "model_run")
        per = collections.Counter()
        for e in events:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                per[e["args"]["op_name"]] += e["dur"]
        spent[who] = {op: us / nruns / 1e3 for op, us in per.most_common()}
        spent[who + "_runs"] = nruns
    result["profile"] = spent
print("RESULT " + json.dumps(result))
"""


def joined_products(layers: int, rounds: int, runs: int) -> dict[str, float]:
    """``--products``: a model of ``layers`` decoder layers' products alone (MatMulNBits,
    int4 symmetric, blocks of 32, int8 compute, random packed weights; one token), the
    seven products of a layer apart as lort's graph has them, or q/k/v and gate/up each
    joined into one product then split, as ORT GenAI's builder packs them. Both sessions
    in this process, 2 threads, interleaved; the medians of each run (ms)."""
    import statistics
    import time

    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    hidden, inter, kv = 1536, 8960, 256
    rng = np.random.default_rng(0)

    def product(nodes, inits, x, k, n, name):
        blocks = k // 32
        inits.append(numpy_helper.from_array(rng.integers(0, 255, (n, blocks, 16), dtype=np.uint8), name + "_B"))
        inits.append(numpy_helper.from_array((rng.standard_normal(n * blocks) * 0.01).astype(np.float32),
                                             name + "_S"))
        nodes.append(helper.make_node("MatMulNBits", [x, name + "_B", name + "_S"], [name], domain="com.microsoft",
                                      K=k, N=n, bits=4, block_size=32, accuracy_level=4))
        return name

    def split(nodes, inits, x, sizes, names):
        inits.append(numpy_helper.from_array(np.array(sizes, np.int64), x + "_sizes"))
        nodes.append(helper.make_node("Split", [x, x + "_sizes"], names, axis=-1))

    def session(joined: bool):
        nodes, inits, x = [], [], "x"
        for layer in range(layers):
            p = f"l{layer}_"
            if joined:
                split(nodes, inits, product(nodes, inits, x, hidden, hidden + 2 * kv, p + "qkv"), [hidden, kv, kv],
                      [p + "q", p + "k", p + "v"])
                split(nodes, inits, product(nodes, inits, x, hidden, 2 * inter, p + "gu"), [inter, inter],
                      [p + "g", p + "u"])
            else:
                for name, n in (("q", hidden), ("k", kv), ("v", kv), ("g", inter), ("u", inter)):
                    product(nodes, inits, x, hidden, n, p + name)
            out = product(nodes, inits, p + "q", hidden, hidden, p + "o")
            nodes.append(helper.make_node("Mul", [p + "g", p + "u"], [p + "gu_"]))
            down = product(nodes, inits, p + "gu_", inter, hidden, p + "d")
            nodes.append(helper.make_node("Add", [out, down], [p + "s"]))
            nodes.append(helper.make_node("Add", [x, p + "s"], [p + "x"]))
            x = p + "x"
        graph = helper.make_graph(nodes, "products", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, hidden])],
                                  [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, hidden])], inits)
        model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18),
                                                                        helper.make_opsetid("com.microsoft", 1)])
        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])

    sessions = {"apart": session(False), "joined": session(True)}
    feed = {"x": (rng.standard_normal((1, hidden)) * 0.1).astype(np.float32)}
    for sess in sessions.values():
        sess.run(None, feed)
    times = {k: [] for k in sessions}
    for r in range(rounds):
        for name in (list(sessions) if r % 2 == 0 else list(sessions)[::-1]):
            for _ in range(runs):
                t0 = time.perf_counter()
                sessions[name].run(None, feed)
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="also a profiled process: each op type's time per run")
    ap.add_argument("--products", action="store_true",
                    help="instead: a model of the layers' products alone, apart against joined (no peers needed)")
    a = ap.parse_args(argv)
    if a.products:
        t = joined_products(a.layers, a.rounds, a.runs)
        print(f"{a.layers} layers' products alone, one token, {a.rounds} rounds x {a.runs} runs: apart "
              f"{t['apart']:.2f} ms, q/k/v and gate/up joined {t['joined']:.2f} ms ({t['apart'] / t['joined']:.3f}x)")
        return
    results = []
    for prof in ([False, True] if a.profile else [False]):
        proc = subprocess.run([sys.executable, "-c", CHILD, BENCH, str(a.layers), str(a.rounds), str(a.runs),
                               "1" if prof else "0"], capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.exit(f"the child failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    r = results[0]
    print(f"{a.layers} layers, a decode step at past length {r['past']}, {a.rounds} rounds x {a.runs} runs:\n")
    print("| graph | run ms (median) |\n|---|---:|")
    print(f"| lort int4 (GroupSession.run) | {r['lort_ms']:.2f} |\n| lort int4, its binding run again "
          f"(ORT's run alone) | {r['lort_ort_ms']:.2f} |\n| ORT GenAI int4 (IOBinding) | {r['genai_ms']:.2f} |")
    print(f"\nGenAI's session options: {r['session_options']}; its inputs: {r['genai_inputs']}")
    for who, key in (("lort's", "lort_ops"), ("ORT GenAI's", "genai_ops")):
        print(f"\n{who} graph as ORT optimized it: " + ", ".join(f"{k} {v}" for k, v in sorted(r[key].items())))
    if a.profile:
        p = results[1]["profile"]
        print(f"\nProfiled (second process; runs: lort {p['lort_runs']}, GenAI {p['genai_runs']}), ms per run:\n")
        ops = sorted(set(p["lort"]) | set(p["genai"]), key=lambda op: -(p["lort"].get(op, 0) + p["genai"].get(op, 0)))
        print("| op | lort ms | GenAI ms |\n|---|---:|---:|")
        for op in ops:
            print(f"| {op} | {p['lort'].get(op, 0):.3f} | {p['genai'].get(op, 0):.3f} |")
        print(f"| all | {sum(p['lort'].values()):.3f} | {sum(p['genai'].values()):.3f} |")


if __name__ == "__main__":
    main()
