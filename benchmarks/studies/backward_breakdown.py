"""Where a training step's backward spends its time, by ATen op family: eager PyTorch
against lort (its ORT groups and what it leaves in PyTorch).

For each model (BERT-base, batch 1 x 128 tokens; timm ResNet-50 at 224 px, batch 8), in
one process:

- **eager**: ``loss.backward()`` of the eager model under torch.profiler; each ATen op's
  self CPU time, summed per family.
- **lort in ORT**: ``torch.compile(model, backend=LortBackend({"executor": "ort"}))``
  with ORT's profiler on in every session; each ORT node's kernel time
  (``*_kernel_time`` events) in the backward graph's sessions, per family of its ONNX
  op type.
- **lort in PyTorch**: the ATen ops of lort's ``loss.backward()`` under torch.profiler
  outside its ORT groups (each group's call is a ``lort::ort_group`` range): what lort
  leaves in PyTorch (``convolution_backward`` by default, see
  Options.decompose_conv_backward), and the autograd engine's own work.

Per step, after ``--warmup`` steps, the mean over ``--steps``. ``wall`` rows are the
median wall-clock of ``loss.backward()`` without profilers. Families map ATen names and
ONNX op types (``ATEN_FAMILIES``, ``ONNX_FAMILIES`` below); names that fall in no family
are listed under the table.

    python benchmarks/studies/backward_breakdown.py [--models bert_base,resnet50] [--steps 5]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this study's folder, then benchmarks/ (the shared modules)

#: ATen op name (without "aten::") -> family: the first family whose prefix matches.
ATEN_FAMILIES = [
    ("matmul", ("mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "addbmm", "_addmm_activation")),
    ("convolution", ("convolution", "convolution_backward", "_convolution", "conv", "mkldnn_convolution",
                     "thnn_conv")),
    ("pooling", ("max_pool", "avg_pool", "adaptive_avg_pool", "_adaptive_avg_pool", "adaptive_max_pool")),
    ("softmax", ("_softmax", "softmax", "_log_softmax", "log_softmax", "_safe_softmax")),
    ("normalization", ("native_layer_norm", "native_batch_norm", "batch_norm", "layer_norm",
                       "_native_batch_norm", "native_group_norm", "_batch_norm")),
    ("reduction", ("sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm", "prod", "argmax")),
    ("data movement", ("view", "reshape", "_reshape_alias", "permute", "transpose", "t", "expand", "clone",
                       "copy_", "copy", "_to_copy", "contiguous", "cat", "slice", "select", "index",
                       "gather", "scatter", "embedding", "as_strided", "squeeze", "unsqueeze", "split",
                       "narrow", "unbind", "stack", "new_zeros", "zeros", "empty", "full", "fill_", "zero_",
                       "resize_", "detach", "alias", "lift_fresh", "unsafe_view", "_unsafe_view",
                       "ones_like", "zeros_like", "empty_like", "empty_strided", "new_empty", "pad",
                       "constant_pad_nd", "repeat", "flip", "roll")),
    ("elementwise", ("add", "mul", "sub", "div", "where", "pow", "rsqrt", "sqrt", "tanh", "erf", "exp",
                     "gelu", "relu", "threshold", "neg", "sigmoid", "silu", "log", "masked_fill", "clamp",
                     "abs", "sign", "eq", "ne", "lt", "le", "gt", "ge", "logical", "bitwise", "reciprocal",
                     "fill", "lerp", "addcmul", "addcdiv", "native_dropout", "dropout", "bernoulli",
                     "maximum", "minimum", "hardtanh", "leaky_relu", "mish", "cos", "sin", "floor", "ceil",
                     "round", "fmod", "remainder", "rsub", "square")),
]
#: ONNX op type -> family (ops ORT's optimizer made count as what they compute).
ONNX_FAMILIES = {
    "matmul": {"MatMul", "Gemm", "FusedMatMul", "FusedGemm", "MatMulNBits", "Attention", "MultiHeadAttention"},
    "convolution": {"Conv", "ConvTranspose", "FusedConv", "NchwcConv", "ReorderInput", "ReorderOutput"},
    "pooling": {"MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "NchwcMaxPool",
                "NchwcAveragePool", "NchwcGlobalAveragePool"},
    "softmax": {"Softmax", "LogSoftmax", "SoftmaxGrad", "BiasSoftmax"},
    "normalization": {"LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
                      "SkipSimplifiedLayerNormalization", "BatchNormalization", "InstanceNormalization"},
    "reduction": {"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2",
                  "ReduceSumSquare", "ArgMax", "ArgMin"},
    "elementwise": {"Add", "Mul", "Sub", "Div", "Where", "Pow", "Sqrt", "Tanh", "Erf", "Exp", "Gelu",
                    "FastGelu", "BiasGelu", "Relu", "Neg", "Sigmoid", "Log", "Equal", "Less", "Greater",
                    "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Abs", "Sign", "Reciprocal", "Max",
                    "Min", "Clip", "Cast", "QuickGelu", "BiasAdd", "Mod", "Floor", "Ceil", "IsNaN",
                    "IsInf", "Sin", "Cos"},
    "data movement": {"Transpose", "Reshape", "Expand", "Concat", "Slice", "Gather", "GatherElements",
                      "GatherND", "ScatterND", "ScatterElements", "Identity", "Unsqueeze", "Squeeze",
                      "Split", "Shape", "ConstantOfShape", "Flatten", "Tile", "Pad", "Range", "Size",
                      "Trilu"},
}
FAMILIES = [f for f, _ in ATEN_FAMILIES] + ["other"]


def aten_family(name: str, unknown: collections.Counter) -> str:
    op = name.split("::", 1)[-1]
    for family, prefixes in ATEN_FAMILIES:
        if any(op == p or op.startswith(p + "_") or op.startswith(p + ".") for p in prefixes):
            return family
    unknown[name] += 1
    return "other"


def onnx_family(op_type: str, unknown: collections.Counter) -> str:
    for family, ops in ONNX_FAMILIES.items():
        if op_type in ops:
            return family
    unknown[op_type] += 1
    return "other"


def build(name: str):
    from lort.testing.models import SCALE_CASES, make_torchvision_importable, output_tensor, timm_model

    make_torchvision_importable()
    if name == "bert_base":
        model, args, kwargs = SCALE_CASES["bert_base"]()
    elif name == "resnet50":
        model, args = timm_model("resnet50", batch=8, size=224)
        kwargs = {}
    else:
        raise SystemExit(f"unknown model {name!r}")
    model.train()
    return model, args, kwargs, lambda out: output_tensor(out).float().pow(2).mean()


def profiled_backward(fn, args, kwargs, loss_of, steps: int, warmup: int, unknown, in_groups: bool):
    """Per family: ms per step of ATen self CPU time in ``loss.backward()`` (outside
    lort's ORT groups when ``in_groups``)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        loss_of(fn(*args, **kwargs)).backward()
    totals = collections.Counter()
    for _ in range(steps):
        loss = loss_of(fn(*args, **kwargs))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss.backward()
        events = prof.events()
        ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name == "lort::ort_group"]
        for e in events:
            if not e.name.startswith("aten::"):
                continue
            if in_groups and any(a <= e.time_range.start and e.time_range.end <= b for a, b in ranges):
                continue  # an op lort runs around its ORT session (output buffers)
            totals[aten_family(e.name, unknown)] += e.self_cpu_time_total / 1e3
    return {k: v / steps for k, v in totals.items()}


def wall_backward(fn, args, kwargs, loss_of, steps: int) -> float:
    times = []
    for _ in range(steps):
        loss = loss_of(fn(*args, **kwargs))
        t0 = time.perf_counter()
        loss.backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def ort_node_times(records, skip_runs: int, unknown) -> tuple[dict, int]:
    """Per family: ms of ORT node kernel time per run in the backward graphs' sessions,
    skipping each session's first ``skip_runs`` runs; and how many runs were counted."""
    totals, runs = collections.Counter(), 0
    for record in records:
        if record.kind != "backward":
            continue
        for group in record.group_modules.values():
            sessions = {id(s): s for d in (group.sessions, group._static_sessions, group._frozen_sessions)
                        for s in d.values()}
            for sess in sessions.values():
                path = sess.session.end_profiling()
                events = json.load(open(path))
                windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
                kept = windows[skip_runs:]
                runs = max(runs, len(kept))
                for e in events:
                    if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
                        continue
                    if not any(a <= e["ts"] <= b for a, b in kept):
                        continue
                    totals[onnx_family(e["args"].get("op_name", "?"), unknown)] += e["dur"] / 1e3
    return ({k: v / max(runs, 1) for k, v in totals.items()}, runs)


def measure(name: str, steps: int, warmup: int) -> dict:
    import lort.runtime.group as group_mod
    import lort.runtime.session as session_mod
    from lort.backend import LortBackend

    unknown_aten, unknown_onnx = collections.Counter(), collections.Counter()
    model, args, kwargs, loss_of = build(name)
    eager = profiled_backward(model, args, kwargs, loss_of, steps, warmup, unknown_aten, False)
    eager_wall = wall_backward(model, args, kwargs, loss_of, steps)

    tmp = tempfile.mkdtemp(prefix="lort-ort-profile-")
    original = session_mod.session_options

    def profiling(options, threads=None, quiet=False):
        so = original(options, threads, quiet)
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "ort")
        return so

    session_mod.session_options = profiling
    forward = group_mod.OrtGroup.forward

    def marked(self, *a):
        with torch.profiler.record_function("lort::ort_group"):
            return forward(self, *a)

    group_mod.OrtGroup.forward = marked
    try:
        # Every group in ORT, on a fixed thread count (no throwaway timing sessions).
        backend = LortBackend({"executor": "ort", "disk_cache": False, "progress": False,
                               "intra_op_num_threads": torch.get_num_threads()})
        compiled = torch.compile(model, backend=backend)
        in_torch = profiled_backward(compiled, args, kwargs, loss_of, steps, warmup, unknown_aten, True)
        lort_wall = wall_backward(compiled, args, kwargs, loss_of, steps)
        in_ort, runs = ort_node_times(backend.records, warmup, unknown_onnx)
    finally:
        session_mod.session_options = original
        group_mod.OrtGroup.forward = forward
    for f in glob.glob(os.path.join(tmp, "*")):
        os.remove(f)
    return dict(eager=eager, in_ort=in_ort, in_torch=in_torch, eager_wall=eager_wall, lort_wall=lort_wall,
                ort_runs=runs, unknown_aten=dict(unknown_aten.most_common(12)),
                unknown_onnx=dict(unknown_onnx.most_common(12)))


def table(name: str, r: dict) -> list[str]:
    lines = [f"### {name}", "",
             "| family | eager ms | lort: in ORT ms | lort: in PyTorch ms | lort total ms | lort / eager |",
             "|---|---:|---:|---:|---:|---:|"]
    for family in FAMILIES + ["all"]:
        if family == "all":
            e, o, t = (sum(r[k].values()) for k in ("eager", "in_ort", "in_torch"))
        else:
            e, o, t = (r[k].get(family, 0.0) for k in ("eager", "in_ort", "in_torch"))
        if family != "all" and max(e, o, t) < 0.05:
            continue
        ratio = f"{(o + t) / e:.2f}" if e >= 0.05 else "-"
        bold = "**" if family == "all" else ""
        lines.append(f"| {bold}{family}{bold} | {e:.1f} | {o:.1f} | {t:.1f} | {o + t:.1f} | {ratio} |")
    lines += ["", f"Wall-clock of `loss.backward()` (median, no profiler): eager {r['eager_wall']:.1f} ms, "
              f"lort {r['lort_wall']:.1f} ms ({r['lort_wall'] / r['eager_wall']:.2f}x eager's). "
              f"ORT runs counted per session: {r['ort_runs']}."]
    if r["unknown_aten"] or r["unknown_onnx"]:
        lines.append(f"In no family (counted as other): ATen {r['unknown_aten']}, ONNX {r['unknown_onnx']}.")
    return lines + [""]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="bert_base,resnet50")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "backward_breakdown.md"))
    a = ap.parse_args(argv)
    import onnxruntime

    from report import machine_line

    lines = [
        "# Where the backward's time goes: eager PyTorch against lort, by ATen op family", "",
        f"Taken {datetime.date.today()} by `python benchmarks/studies/backward_breakdown.py "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"({a.steps} profiled steps after {a.warmup} warm-up steps).", machine_line(),
        f"onnxruntime {onnxruntime.__version__}, Python {platform.python_version()}.", "",
        "BERT-base: transformers BertModel(BertConfig()), batch 1 x 128 tokens, train mode (dropout 0.1). "
        "ResNet-50: timm, batch 8 at 224 px, train mode. Loss: the output's mean square. How each column "
        "is taken: the module docstring of benchmarks/studies/backward_breakdown.py. Profilers add their own cost "
        "to each op: the wall-clock line under each table is the step without them.", "",
    ]
    for name in a.models.split(","):
        r = measure(name, a.steps, a.warmup)
        print(name, json.dumps(r), flush=True)
        lines += table(name, r)
    text = "\n".join(lines)
    print(text)
    # A reading written by hand below the tables is kept.
    old = open(a.out).read() if os.path.exists(a.out) else ""
    reading = old[old.index("<!-- reading"):] if "<!-- reading" in old else ""
    with open(a.out, "w") as f:
        f.write(text.rstrip() + "\n" + ("\n" + reading if reading else ""))


if __name__ == "__main__":
    main()
