"""Which float32 GEMM is fastest at a training step's products: MKL, OpenBLAS, ORT, oneDNN.

Issue 43 asks for a training step faster than eager's, and a BERT-base step is about 90%
products (studies/fused_backward.md). So the question is whether any GEMM this machine
already has beats the one eager calls, at the shapes such a step multiplies:

- ``mkl``: ``torch.mm`` on the operands as the step holds them (a linear layer's weight
  transposed as a view, the weight gradient's ``dY^T X`` as a transposed view): MKL's
  sgemm, which eager, AOTAutograd's graphs and inductor's extern kernels call;
- ``openblas``: ``numpy.matmul`` on the same memory (NumPy's own OpenBLAS), into a
  preallocated output;
- ``ort``: one ONNX ``Gemm`` with the transpose flags, in an ORT session with torch's
  thread count (MLAS, what lort's ORT groups run);
- ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` on dense operands (oneDNN's
  matmul, the kernel inductor's CPU linear fusions call).

The tables go between the file's ``<!-- gemm_libraries -->`` markers; the reading after them
is kept. Each library runs in a fresh process of its own (libraries that spin their threads
after a call slow the next library's threads when they alternate in one process:
``--mixed`` measures that), the processes taking turns for ``--rounds`` rounds; each
row gives the median over rounds of each process's median of 15 calls, and the range.
Then, with ``--step``, the whole training step of BERT-base (forward and backward, no
optimizer, batch 4 x 128) in eager PyTorch, and with its ``mm``/``addmm`` computed by
OpenBLAS instead (a TorchDispatchMode), each in fresh processes taking turns: what the
faster GEMM is worth in a real step, where torch's OpenMP threads run the ops between.
With ``--waits``, the alternating pair again under each setting of ``WAITS`` (whose
threads wait by spinning after a call), set before the child process starts. With
``--ort-forms``, the weight gradients' ``dY^T X`` in ORT written each way of
``ORT_FORMS`` (issue 43, item 2: which form ORT runs fastest per shape), at batch 1 and 4.

    python benchmarks/studies/gemm_libraries.py [--rounds 3] [--step] [--mixed] [--waits] [--ort-forms]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from report import machine, write_section  # noqa: E402
from timing import median_seconds  # noqa: E402

#: name -> (A's shape, B's shape, transA, transB): BERT-base's products at batch 4 x 128
#: (512 tokens), as the step holds them (torch's linear weight is [out, in]).
SHAPES = {
    "fwd QKV/out: X[512,768] W[768,768]^T": ((512, 768), (768, 768), 0, 1),
    "fwd FFN up: X[512,768] W[3072,768]^T": ((512, 768), (3072, 768), 0, 1),
    "fwd FFN down: X[512,3072] W[768,3072]^T": ((512, 3072), (768, 3072), 0, 1),
    "bwd dX of FFN up: dY[512,3072] W[3072,768]": ((512, 3072), (3072, 768), 0, 0),
    "bwd dW of FFN up: dY[512,3072]^T X[512,768]": ((512, 3072), (512, 768), 1, 0),
    "bwd dW of FFN down: dY[512,768]^T X[512,3072]": ((512, 768), (512, 3072), 1, 0),
}
LIBRARIES = ("mkl", "openblas", "ort", "onednn")
#: Environment settings for ``--waits``: torch's OpenMP threads sleep at once after a
#: parallel region (OMP_WAIT_POLICY, read when libgomp loads), OpenBLAS's spin for 2^4
#: cycles instead of its default 2^28 (OPENBLAS_THREAD_TIMEOUT, read when it loads).
WAITS = {
    "as they are (both spin)": {},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "OPENBLAS_THREAD_TIMEOUT=4": {"OPENBLAS_THREAD_TIMEOUT": "4"},
    "both": {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_THREAD_TIMEOUT": "4"},
}


#: The ways of writing ``dY^T X`` in ONNX for ``--ort-forms``: the node(s), and the ORT
#: optimizers the session leaves out (its MatmulTransposeFusion turns Transpose + MatMul
#: into FusedMatMul(transA=1), as onnxscript's TransposeMatMul rules do before it).
ORT_FORMS = {
    "Gemm(transA=1)": ([("Gemm", ["a", "b"], ["y"], {"transA": 1})], []),
    "FusedMatMul(transA=1)": ([("FusedMatMul", ["a", "b"], ["y"], {"transA": 1, "domain": "com.microsoft"})], []),
    "Transpose, MatMul (unfused)": ([("Transpose", ["a"], ["at"], {"perm": [1, 0]}), ("MatMul", ["at", "b"], ["y"], {})],
                                    ["MatmulTransposeFusion", "TransposeOptimizer"]),
}
#: (M, K, N) of dW = dY^T X: dY [K, M], X [K, N], K the tokens (BERT-base, batch 1 and 4).
ORT_FORM_SHAPES = [(768, 128, 768), (3072, 128, 768), (768, 512, 768), (3072, 512, 768), (768, 512, 3072)]


def _ort_session(nodes, a_shape, b_shape, y_shape, disabled=()):
    """An ORT session of ``nodes`` (``(op, inputs, outputs, attributes)``, a ``domain``
    among the attributes) from float inputs ``a``, ``b`` to ``y``, on torch's thread
    count, with the ORT optimizers ``disabled`` left out."""
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node(op, ins, outs, **attrs) for op, ins, outs, attrs in nodes], "product",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, list(a_shape)),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, list(b_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y_shape))])
    model = helper.make_model(graph, ir_version=9, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"],
                                disabled_optimizers=list(disabled))


def child_ort_forms() -> dict:
    """{form: {"MxKxN": seconds}} for ``--ort-forms``, one session per form and shape."""
    import numpy as np

    out: dict = {form: {} for form in ORT_FORMS}
    for form, (nodes, disabled) in ORT_FORMS.items():
        for m, k, n in ORT_FORM_SHAPES:
            sess = _ort_session(nodes, (k, m), (k, n), (m, n), disabled)
            feeds = {"a": np.random.randn(k, m).astype(np.float32), "b": np.random.randn(k, n).astype(np.float32)}
            out[form][f"{m}x{k}x{n}"] = median_seconds(lambda: sess.run(None, feeds))
    return out


def _product(lib: str, sa, sb, ta, tb):
    """A no-argument callable computing op(A) @ op(B) with ``lib``."""
    import numpy as np
    import torch

    a, b = torch.randn(*sa), torch.randn(*sb)
    at, bt = (a.t() if ta else a), (b.t() if tb else b)
    if lib == "mkl":
        return lambda: torch.mm(at, bt)
    if lib == "openblas":
        an, bn = at.numpy(), bt.numpy()
        out = np.empty((an.shape[0], bn.shape[1]), dtype=np.float32)
        return lambda: np.matmul(an, bn, out=out)
    if lib == "ort":
        y = (at.shape[0], bt.shape[1])
        sess = _ort_session([("Gemm", ["a", "b"], ["y"], {"transA": ta, "transB": tb})], sa, sb, y)
        feeds = {"a": a.numpy(), "b": b.numpy()}
        return lambda: sess.run(None, feeds)
    if lib == "onednn":
        w = bt.t()  # [N, K], as linear takes its weight
        return lambda: torch.ops.mkldnn._linear_pointwise(at, w, None, "none", [], "")
    raise ValueError(lib)


def child_products(libs: list[str]) -> dict:
    """{library: {shape: seconds}}; several libraries in one process alternate per call."""
    fns = {(lib, name): _product(lib, *spec) for name, spec in SHAPES.items() for lib in libs}
    if len(libs) == 1:
        return {libs[0]: {name: median_seconds(fns[(libs[0], name)]) for name in SHAPES}}
    out: dict = {lib: {} for lib in libs}
    for name in SHAPES:  # alternate the libraries call by call
        times: dict = {lib: [] for lib in libs}
        for _ in range(15):
            for lib in libs:
                t0 = time.perf_counter()
                fns[(lib, name)]()
                times[lib].append(time.perf_counter() - t0)
        for lib in libs:
            out[lib][name] = statistics.median(times[lib][3:])
    return out


def child_step(variant: str, steps: int = 5) -> dict:
    """Median seconds of BERT-base's forward and backward (batch 4 x 128) in eager
    PyTorch, its products through MKL (``eager``) or OpenBLAS (``openblas``)."""
    import numpy as np
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from lort.testing.models import ENGINE_CASES

    aten = torch.ops.aten

    class OpenBlasProducts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in (aten.mm.default, aten.addmm.default) and not kwargs and args[-1].dtype == torch.float32:
                a, b = args[-2].detach(), args[-1].detach()
                out = torch.empty(a.shape[0], b.shape[1])
                np.matmul(a.numpy(), b.numpy(), out=out.numpy())
                if func is aten.addmm.default:
                    out += args[0]
                return out
            return func(*args, **kwargs)

    model, args, kwargs = ENGINE_CASES["bert_base"](4)
    model.train()

    def step():
        mode = OpenBlasProducts() if variant == "openblas" else None
        if mode is not None:
            mode.__enter__()
        try:
            model(*args, **kwargs)[0].pow(2).mean().backward()
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
        model.zero_grad(set_to_none=True)

    return {variant: median_seconds(step, calls=steps, warmup=2)}


def _run_child(kind: str, arg: str, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, arg], check=True,
                         capture_output=True, text=True, env={**os.environ, **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fmt(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med * 1e3:.2f} ({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--step", action="store_true", help="also BERT-base's step with MKL's and OpenBLAS's products")
    p.add_argument("--mixed", action="store_true", help="also mkl and openblas alternating in one process")
    p.add_argument("--waits", action="store_true", help="also the alternating pair under each of WAITS")
    p.add_argument("--ort-forms", action="store_true", help="also dY^T X in ORT written each way of ORT_FORMS")
    p.add_argument("--out", default=os.path.join(HERE, "gemm_libraries.md"))
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        kind, arg = a.child
        if kind == "products":
            result = child_products(arg.split(","))
        else:
            result = child_ort_forms() if kind == "ort_forms" else child_step(arg)
        print(json.dumps(result))
        return
    samples: dict = {lib: {name: [] for name in SHAPES} for lib in LIBRARIES}
    mixed: dict = {lib: {name: [] for name in SHAPES} for lib in ("mkl", "openblas")}
    steps: dict = {"eager": [], "openblas": []}
    forms: dict = {form: {f"{m}x{k}x{n}": [] for m, k, n in ORT_FORM_SHAPES} for form in ORT_FORMS}
    waits: dict = {w: {lib: {name: [] for name in SHAPES} for lib in ("mkl", "openblas")} for w in WAITS}
    for _ in range(a.rounds):
        for lib in LIBRARIES:
            for name, s in _run_child("products", lib)[lib].items():
                samples[lib][name].append(s)
        if a.mixed:
            for lib, by_name in _run_child("products", "mkl,openblas").items():
                for name, s in by_name.items():
                    mixed[lib][name].append(s)
        if a.ort_forms:
            for form, by_shape in _run_child("ort_forms", "-").items():
                for shape, t in by_shape.items():
                    forms[form][shape].append(t)
        if a.waits:
            for w, env in WAITS.items():
                for lib, by_name in _run_child("products", "mkl,openblas", env).items():
                    for name, s in by_name.items():
                        waits[w][lib][name].append(s)
        if a.step:
            for variant in steps:
                steps[variant].append(_run_child("step", variant)[variant])
    lines = [
        f"Taken {datetime.date.today()} by `python benchmarks/studies/gemm_libraries.py --rounds {a.rounds}"
        f"{' --step' if a.step else ''}{' --mixed' if a.mixed else ''}{' --waits' if a.waits else ''}"
        f"{' --ort-forms' if a.ort_forms else ''}`.",
        f"Machine: {machine()}. How each figure is taken: the script's docstring; "
        "ms: median over rounds (range), one fresh process per library and round.",
        "",
        "| product (BERT-base, batch 4 x 128) | GFLOP | " + " | ".join(f"{lib} ms" for lib in LIBRARIES)
        + " | fastest | mkl / fastest |",
        "|---|---:|" + "---:|" * len(LIBRARIES) + "---|---:|",
    ]
    for name, (sa, sb, ta, tb) in SHAPES.items():
        m, k = (sa[1], sa[0]) if ta else sa
        n = sb[0] if tb else sb[1]
        meds = {lib: statistics.median(samples[lib][name]) for lib in LIBRARIES}
        fastest = min(meds, key=meds.get)
        lines.append(f"| {name} | {2 * m * k * n / 1e9:.2f} | "
                     + " | ".join(_fmt(samples[lib][name]) for lib in LIBRARIES)
                     + f" | {fastest} | {meds['mkl'] / meds[fastest]:.2f}x |")
    if a.mixed:
        lines += ["", "MKL and OpenBLAS alternating call by call in one process (ms):", "",
                  "| product | mkl ms | openblas ms |", "|---|---:|---:|"]
        lines += [f"| {name} | {_fmt(mixed['mkl'][name])} | {_fmt(mixed['openblas'][name])} |" for name in SHAPES]
    if a.ort_forms:
        shapes = list(next(iter(forms.values())))
        lines += ["", "dW = dY^T X in ORT, each way of writing it (ms; M x K x N, K the tokens):", "",
                  "| form | " + " | ".join(shapes) + " |", "|---|" + "---:|" * len(shapes)]
        lines += [f"| {form} | " + " | ".join(_fmt(forms[form][sh]) for sh in shapes) + " |" for form in ORT_FORMS]
    if a.waits:
        lines += ["", "The same alternation under each thread-wait setting: the sum over the six products (ms):", "",
                  "| setting | mkl ms | openblas ms |", "|---|---:|---:|"]
        for w in WAITS:
            sums = {lib: [sum(v) for v in zip(*waits[w][lib].values())] for lib in ("mkl", "openblas")}
            lines.append(f"| {w} | {_fmt(sums['mkl'])} | {_fmt(sums['openblas'])} |")
        alone = {lib: [sum(v) for v in zip(*samples[lib].values())] for lib in ("mkl", "openblas")}
        lines.append(f"| each alone (the first table) | {_fmt(alone['mkl'])} | {_fmt(alone['openblas'])} |")
    if a.step:
        lines += ["", "BERT-base forward + backward, batch 4 x 128, eager PyTorch (ms):", "",
                  "| products through | step ms |", "|---|---:|"]
        lines += [f"| {'MKL (eager as it is)' if v == 'eager' else 'OpenBLAS'} | {_fmt(t)} |" for v, t in steps.items()]
    print("\n".join(lines))
    write_section(a.out, "gemm_libraries", lines, title="# Float32 GEMM libraries at a training step's products\n")


if __name__ == "__main__":
    main()
