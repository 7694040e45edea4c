"""PyTorch's spinning OpenMP workers and ORT runs in one process (Options.release_openmp).

After a parallel region, libgomp's workers (PyTorch's Linux wheels) spin for
``GOMP_SPINCOUNT`` iterations before they sleep, holding cores that an ORT run started
then needs. Three parts, each printed as a Markdown table:

1. ``--micro``: an ORT MatMul [512x3072] x [3072x768] (2 threads, spinning off) timed
   right after another product (``alone``), right after a PyTorch GELU, after a GELU and a
   5 ms sleep, and after a GELU then ``omp_pause_resource_all`` (lort's release); with
   ``torch.mm`` of the same shape for scale. 30 rounds in each of three fresh processes:
   as they are, ``GOMP_SPINCOUNT=0`` and ``OMP_WAIT_POLICY=PASSIVE``; medians in ms.
2. ``--cases``: a training step (forward, loss, backward, no optimizer) of each case
   (``lort.testing.models.ENGINE_CASES``) in eager PyTorch and compiled with
   ``executor="ort"`` twice, ``release_openmp=False`` and the default (training graphs
   release), each on its own copy of the model; ``--rounds`` rounds in turn, the order
   reversed every other round; medians in ms, ratios eager / lort.
3. ``--products``: BERT-base's eager step (batch 4 x 128) with every float32 ``mm`` /
   ``addmm`` computed by ORT (``FusedMatMul`` with transpose flags, a bias ``Add``; a
   ``TorchDispatchMode``), with and without a release before each product, against
   eager: does a product placed in ORT win inside PyTorch's step?

    python benchmarks/studies/openmp_spin.py [--micro] [--cases bert_base:4,gpt2_small:4] [--rounds 8] [--products]

The reading is in benchmarks/studies/openmp_spin.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
sys.path.insert(0, BENCH)

MICRO = r"""
import json, statistics, time
import numpy as np, onnxruntime as ort, torch
from onnx import TensorProto, helper
from lort.runtime import openmp
M, K, N = 512, 3072, 768
g = helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["Y"])], "p",
    [helper.make_tensor_value_info("A", TensorProto.FLOAT, [M, K]), helper.make_tensor_value_info("B", TensorProto.FLOAT, [K, N])],
    [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [M, N])])
so = ort.SessionOptions(); so.intra_op_num_threads = torch.get_num_threads()
so.add_session_config_entry("session.intra_op.allow_spinning", "0")
s = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString(),
                         so, providers=["CPUExecutionProvider"])
a, b, y, x = torch.randn(M, K), torch.randn(K, N), torch.empty(M, N), torch.randn(M, K)
io = s.io_binding()
io.bind_input("A", "cpu", 0, np.float32, [M, K], a.data_ptr()); io.bind_input("B", "cpu", 0, np.float32, [K, N], b.data_ptr())
io.bind_output("Y", "cpu", 0, np.float32, [M, N], y.data_ptr())
release = openmp.release_function()
def ort_run():
    t = time.perf_counter(); s.run_with_iobinding(io); return time.perf_counter() - t
def gelu(): torch.nn.functional.gelu(x)
T = {k: [] for k in ("alone", "after a GELU", "after a GELU + 5 ms", "after a GELU + release", "torch.mm")}
for _ in range(30):
    T["alone"].append(ort_run())
    gelu(); T["after a GELU"].append(ort_run())
    gelu(); time.sleep(0.005); T["after a GELU + 5 ms"].append(ort_run())
    gelu(); release(); T["after a GELU + release"].append(ort_run())
    gelu(); t = time.perf_counter(); torch.mm(a, b, out=y); T["torch.mm"].append(time.perf_counter() - t)
print("RESULT " + json.dumps({k: statistics.median(v) * 1e3 for k, v in T.items()}))
"""


def micro() -> list[str]:
    rows = {}
    for label, env in (("as they are", {}), ("GOMP_SPINCOUNT=0", {"GOMP_SPINCOUNT": "0"}),
                       ("OMP_WAIT_POLICY=PASSIVE", {"OMP_WAIT_POLICY": "PASSIVE"})):
        proc = subprocess.run([sys.executable, "-c", MICRO], capture_output=True, text=True,
                              env={**os.environ, **env})
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            raise SystemExit(f"micro ({label}) failed: {proc.stderr.strip()[-500:]}")
        rows[label] = json.loads(line[-1][len("RESULT "):])
    cols = list(next(iter(rows.values())))
    lines = ["| OpenMP setting | " + " | ".join(f"ORT MatMul {c}" if c != "torch.mm" else c for c in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    lines += [f"| {label} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + " |" for label, r in rows.items()]
    return lines


def _step(models, model, fn, args):
    loss = models.output_tensor(fn(*args)).float().sum() * 1e-3
    loss.backward()
    for p in model.parameters():
        p.grad = None


def training(cases: list[tuple[str, int]], rounds: int) -> list[str]:
    import copy

    import torch

    from lort.testing import models

    lines = ["| case | eager ms | lort, no release ms | lort, release ms | eager / no release | eager / release |",
             "|---|---:|---:|---:|---:|---:|"]
    for case, batch in cases:
        model, args = models.ENGINE_CASES[case](batch)[:2]
        model.train()
        copies = {"eager": model, "off": copy.deepcopy(model), "on": copy.deepcopy(model)}
        base = {"executor": "ort", "engines": ("ort", "pytorch"), "disk_cache": False, "progress": False}
        fns = {"eager": model,
               "off": torch.compile(copies["off"], backend="lort", options={**base, "release_openmp": False}),
               "on": torch.compile(copies["on"], backend="lort", options=base)}
        for name, fn in fns.items():
            _step(models, copies[name], fn, args)
            _step(models, copies[name], fn, args)
        times = {k: [] for k in fns}
        for r in range(rounds):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                t0 = time.perf_counter()
                _step(models, copies[name], fns[name], args)
                times[name].append(time.perf_counter() - t0)
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        lines.append(f"| {case}, batch {batch} | {ms['eager']:.1f} | {ms['off']:.1f} | {ms['on']:.1f} | "
                     f"{ms['eager'] / ms['off']:.3f}x | {ms['eager'] / ms['on']:.3f}x |")
        del fns, copies, model
        torch._dynamo.reset()
    return lines


def products(rounds: int) -> list[str]:
    import numpy as np
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper
    from torch.utils._python_dispatch import TorchDispatchMode

    from lort.runtime import openmp
    from lort.testing import models

    aten, sessions, state = torch.ops.aten, {}, {"release": False}
    release = openmp.release_function()

    def operand(t):  # (contiguous 2-D tensor, transposed flag) or None
        if t.is_contiguous():
            return t, 0
        if t.dim() == 2 and t.stride(0) == 1 and t.stride(1) == t.shape[0]:
            return t.t(), 1
        return None

    def session(key):
        if key not in sessions:
            (sa, ta), (sb, tb), bias = key
            m, n = (sa[1] if ta else sa[0]), (sb[0] if tb else sb[1])
            ins = [helper.make_tensor_value_info("A", TensorProto.FLOAT, list(sa)),
                   helper.make_tensor_value_info("B", TensorProto.FLOAT, list(sb))]
            nodes = [helper.make_node("FusedMatMul", ["A", "B"], ["P" if bias else "Y"], domain="com.microsoft",
                                      transA=ta, transB=tb)]
            if bias:
                ins.append(helper.make_tensor_value_info("C", TensorProto.FLOAT, [n]))
                nodes.append(helper.make_node("Add", ["P", "C"], ["Y"]))
            g = helper.make_graph(nodes, "p", ins, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [m, n])])
            mp = helper.make_model(g, ir_version=9, opset_imports=[helper.make_opsetid("", 17),
                                                                   helper.make_opsetid("com.microsoft", 1)])
            so = ort.SessionOptions()
            so.intra_op_num_threads, so.inter_op_num_threads = torch.get_num_threads(), 1
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            sessions[key] = ort.InferenceSession(mp.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return sessions[key]

    def run(key, a, b, c, m, n):
        s, out = session(key), torch.empty(m, n)
        io = s.io_binding()
        for name, t in (("A", a), ("B", b), ("C", c)):
            if t is not None:
                io.bind_input(name, "cpu", 0, np.float32, list(t.shape), t.data_ptr())
        io.bind_output("Y", "cpu", 0, np.float32, [m, n], out.data_ptr())
        if state["release"] and release is not None:
            release()
        s.run_with_iobinding(io)
        return out

    class OrtProducts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (aten.mm.default, aten.addmm.default) and not kwargs:
                c, a, b = (None, *args) if func is aten.mm.default else args[:3]
                ok = func is aten.mm.default or (len(args) == 3 and c.dim() == 1 and c.is_contiguous())
                oa, ob = operand(a), operand(b)
                if ok and oa and ob and a.dtype == torch.float32 and min(a.numel(), b.numel()) > 0:
                    key = ((tuple(oa[0].shape), oa[1]), (tuple(ob[0].shape), ob[1]), c is not None)
                    return run(key, oa[0], ob[0], c, a.shape[0], b.shape[1])
            return func(*args, **(kwargs or {}))

    model, args = models.ENGINE_CASES["bert_base"](4)[:2]
    model.train()

    def step(variant):
        state["release"] = variant == "products in ORT, release"
        if variant == "eager":
            return _step(models, model, model, args)
        with OrtProducts():
            _step(models, model, model, args)

    variants = ("eager", "products in ORT", "products in ORT, release")
    for v in variants:
        step(v)
    times = {v: [] for v in variants}
    for r in range(rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            t0 = time.perf_counter()
            step(v)
            times[v].append(time.perf_counter() - t0)
    ms = {v: statistics.median(t) * 1e3 for v, t in times.items()}
    lines = ["| BERT-base step, batch 4 x 128 | ms | eager / it |", "|---|---:|---:|"]
    lines += [f"| {v} | {ms[v]:.1f} | {ms['eager'] / ms[v]:.3f}x |" for v in variants]
    return lines + ["", f"({len(sessions)} product shapes.)"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--micro", action="store_true", help="the ORT MatMul after a PyTorch op, three OpenMP settings")
    ap.add_argument("--cases", default="", help="training steps, e.g. bert_base:4,gpt2_small:4")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--products", action="store_true", help="BERT-base's eager step with its products in ORT")
    a = ap.parse_args(argv)
    import report

    print(f"`{report.command('studies/openmp_spin.py', argv)}`; {report.machine_line()}")
    if a.micro:
        print("\n" + "\n".join(micro()))
    if a.cases:
        cases = [(c.split(":")[0], int(c.split(":")[1]) if ":" in c else 4) for c in a.cases.split(",")]
        print("\n" + "\n".join(training(cases, a.rounds)))
    if a.products:
        print("\n" + "\n".join(products(a.rounds)))


if __name__ == "__main__":
    main()
