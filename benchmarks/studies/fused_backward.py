"""Which fused backward kernels lort keeps whole: a training step with each of them run
whole in PyTorch's kernel against ORT running its decomposition (issue 43, item 2).

PyTorch decomposes batch norm's, layer norm's, softmax's and GELU's backward (and the
loss's) into elementwise ops and reductions, which ORT runs inside its groups. Kept whole,
the op runs in PyTorch's fused kernel instead, between two ORT groups.
capture/decompositions/__init__.py keeps whole the ones that win here.

For each case, one process holds one copy of the model per variant, with the same
weights: eager PyTorch, and ``torch.compile(backend="lort")`` with ``executor="ort"``
(every group ORT supports in ORT, so that the variants differ only by the op), under lort's
decomposition table ("lort's policy") and under that table with one op moved (kept whole
where lort decomposes it, decomposed where lort keeps it). A step is forward, the output's
mean square (the model's own loss where it has one), backward and ``zero_grad``; the
steps are timed interleaved (benchmarks/timing.py), ``--repeats`` samples, median.

    python benchmarks/studies/fused_backward.py [--cases bert_base:4,resnet50:8] [--repeats 7]

Writes its section of benchmarks/studies/fused_backward.md (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this study's folder, then benchmarks/ (the shared modules)

from report import machine, write_section  # noqa: E402
from timing import timed_interleaved  # noqa: E402

aten = torch.ops.aten
OPS = {
    "batch norm": aten.native_batch_norm_backward.default,
    "layer norm": aten.native_layer_norm_backward.default,
    "softmax": aten._softmax_backward_data.default,
    "GELU": aten.gelu_backward.default,
}
#: The ops each case has, moved one at a time.
CASE_OPS = {"bert_base": ("layer norm", "softmax", "GELU"), "resnet50": ("batch norm",)}


def build(case: str, batch: int):
    from lort.testing import models

    if case == "resnet50":
        return models.timm_model("resnet50", batch=batch, size=224)
    return models.bert_base(batch=batch)


def decomposed_by_lort(op, decomps=None) -> bool:
    """Whether lort's table (or ``decomps``) traces ``op`` with PyTorch's own decomposition."""
    from lort.capture import decompositions

    decomps = decompositions.table() if decomps is None else decomps
    return op in decomps and decomps[op] is torch._decomp.decomposition_table.get(op)


@contextlib.contextmanager
def moved(op):
    """lort's decomposition table with ``op`` moved: popped where lort decomposes it,
    PyTorch's decomposition where lort keeps it whole."""
    from lort.capture import decompositions

    original = decompositions.table

    def table(*args, **kwargs):
        decomps = dict(original(*args, **kwargs))
        if decomposed_by_lort(op, decomps):
            decomps.pop(op)
        else:
            decomps[op] = torch._decomp.decomposition_table[op]
        return decomps

    decompositions.table = table  # read by lort's backend at each compile
    try:
        yield
    finally:
        decompositions.table = original


def run_case(case: str, batch: int, repeats: int) -> list[str]:
    import lort
    from lort.testing.models import output_tensor

    made = build(case, batch)
    model, args = made[0], made[1]
    model.train(True)
    variants = {"eager": None, "lort's policy": None}
    for name in CASE_OPS[case]:
        variants[f"{name} {'whole' if decomposed_by_lort(OPS[name]) else 'decomposed'}"] = OPS[name]
    steps = {}
    for label, op in variants.items():
        m = copy.deepcopy(model)
        fn = m if label == "eager" else torch.compile(
            m, backend=lort.LortBackend({"executor": "ort", "disk_cache": False, "progress": False}))

        def step(fn=fn, m=m):
            out = output_tensor(fn(*args))
            out.float().pow(2).mean().backward()
            m.zero_grad(set_to_none=True)

        with moved(op) if op is not None else contextlib.nullcontext():
            step()  # compiles under this variant's table
        steps[label] = step
    del model
    times = timed_interleaved(steps, min_time=0.0, repeats=repeats)
    policy = times["lort's policy"]
    what = f"{case}, batch {batch}" + (" x 128 tokens" if case == "bert_base" else " at 224 px")
    lines = [f"### {what}", "", "| variant | step ms | vs lort's policy | vs eager |", "|---|---:|---:|---:|"]
    for label, t in times.items():
        lines.append(f"| {label} | {t * 1e3:.1f} | {policy / t:.2f}x | {times['eager'] / t:.2f}x |")
    return lines + [""]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="bert_base:4,resnet50:8")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(HERE, "fused_backward.md"))
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    lines = [f"## `python benchmarks/studies/fused_backward.py --cases {a.cases} --repeats {a.repeats}`", "",
             f"Taken {datetime.date.today()} on {machine()}. How: the script's docstring; \"x\" columns are "
             "speed-ups (above 1: faster than the reference).", ""]
    for spec in a.cases.split(","):
        case, batch = spec.split(":")
        lines += run_case(case, int(batch), a.repeats)
    write_section(a.out, f"fused_backward {a.cases}", lines, title="# Fused backward kernels: kept whole or decomposed")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
