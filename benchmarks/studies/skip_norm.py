"""ORT's CPU kernels of the skip-norm ops against the ops they fuse.

onnxscript's ORT fusions turn a residual Add and the norm after it into ORT's
``SkipLayerNormalization`` (LayerNorm) or ``SkipSimplifiedLayerNormalization`` (RMS
norm). Each model here chains 24 of them (the residual sum also an output, as a
transformer uses it), fused or as Add + LayerNormalization / Add +
SimplifiedLayerNormalization, and times the two sessions round-robin (ORT's optimizer
off, so each runs as built; medians of 200 rounds less 20 of warm-up).

    python benchmarks/studies/skip_norm.py [--threads 1,2]

Prints the table of benchmarks/studies/skip_norm.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

SHAPES = [(17, 192), (136, 192), (128, 768), (1, 768), (16, 1024), (1, 1024)]


def chain(rows: int, hidden: int, fused: bool, rms: bool, reps: int = 24) -> bytes:
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(reps):
        inits.append(numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), f"g{i}"))
        norm_in = [f"g{i}"]
        if not rms:
            inits.append(numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), f"b{i}"))
            norm_in.append(f"b{i}")
        if fused:
            op = "SkipSimplifiedLayerNormalization" if rms else "SkipLayerNormalization"
            nodes.append(helper.make_node(op, [prev, "s", *norm_in], [f"y{i}", "", "", f"sum{i}"],
                                          domain="com.microsoft", epsilon=1e-6))
        else:
            op = "SimplifiedLayerNormalization" if rms else "LayerNormalization"
            nodes.append(helper.make_node("Add", [prev, "s"], [f"sum{i}"]))
            nodes.append(helper.make_node(op, [f"sum{i}", *norm_in], [f"y{i}"], axis=-1, epsilon=1e-6))
        prev = f"y{i}"

    def info(name):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, rows, hidden])

    graph = helper.make_graph(nodes, "chain", [info("x"), info("s")], [info(prev)], inits)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


def time_pair(rows: int, hidden: int, rms: bool, threads: int) -> tuple[float, float]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sessions = {f: ort.InferenceSession(chain(rows, hidden, f, rms), so, providers=["CPUExecutionProvider"])
                for f in (True, False)}
    x = np.random.default_rng(1).random((1, rows, hidden), dtype=np.float32)
    times = {f: [] for f in sessions}
    for _ in range(200):
        for f, s in sessions.items():
            t0 = time.perf_counter()
            s.run(None, {"x": x, "s": x})
            times[f].append(time.perf_counter() - t0)
    return tuple(statistics.median(times[f][20:]) * 1e3 for f in (True, False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    a = ap.parse_args()
    print(f"{platform.processor() or platform.machine()}, onnxruntime {ort.__version__}")
    print("| norm | threads | rows x hidden | 24 fused ms | 24 Add + norm ms | fused / unfused |")
    print("|---|---:|---|---:|---:|---:|")
    for rms in (False, True):
        for threads in (int(t) for t in a.threads.split(",")):
            for rows, hidden in SHAPES:
                fused, plain = time_pair(rows, hidden, rms, threads)
                name = "SkipSimplifiedLayerNormalization" if rms else "SkipLayerNormalization"
                print(f"| {name} | {threads} | {rows} x {hidden} | {fused:.3f} | {plain:.3f} | {fused / plain:.2f}x |",
                      flush=True)


if __name__ == "__main__":
    main()
