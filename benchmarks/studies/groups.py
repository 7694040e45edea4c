"""Per model: how lort partitions it (graphs, ORT groups, ATen nodes in ORT), the weights
frozen into inference sessions, the largest group's inputs, and which of onnxscript's
ORT fusion rewrites fired, for inference (batch 1) and a training step (batch 8).
Compiles only (executor="ort", so every group is translated and counted); writes
benchmarks/studies/groups.md.

    python benchmarks/studies/groups.py [--models bert,gpt2] [--max-group-args N] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import sys

import torch

from lort.testing.models import CASES, make_torchvision_importable, output_tensor

make_torchvision_importable()

import lort  # noqa: E402


def partition(name: str, train: bool, max_group_args: int = 128) -> dict:
    torch._dynamo.reset()
    model, args = CASES[name].make(8 if train else 1, seed=0)
    model = copy.deepcopy(model)
    backend = lort.LortBackend({"executor": "ort", "disk_cache": False, "max_group_args": max_group_args})
    cm = torch.compile(model, backend=backend)
    if train:
        output_tensor(cm(*args)).float().pow(2).mean().backward()
    else:
        model.eval()
        with torch.no_grad():
            cm(*args)
    report = lort.ExplainReport(backend.records)
    fusions = collections.Counter()
    for g in report.groups:
        fusions.update(g.fusions)
    left = collections.Counter(op for op, _ in report.fallbacks)
    return {
        "graphs": len(report.records),
        "groups": len(report.groups),
        "ort": report.ort_nodes,
        "total": report.ort_nodes + report.torch_nodes,
        "fusions": ", ".join(f"{k} x{v}" for k, v in sorted(fusions.items())) or "-",
        "left": ", ".join(f"{op.replace('aten.', '')} x{c}" for op, c in left.most_common(3)) or "-",
        "frozen": sum(g.frozen for g in report.groups),
        "kept": sum(sum(g.kept_inputs.values()) for g in report.groups),
        "widest": max((g.num_inputs - g.frozen + g.num_outputs for g in report.groups), default=0),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(CASES))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "groups.md"))
    ap.add_argument("--max-group-args", type=int, default=128)
    a = ap.parse_args(argv)
    lines = [
        "# How lort partitions each model",
        "",
        "Taken by `python benchmarks/studies/groups.py`: graphs captured, ORT groups, ATen nodes in ORT,",
        "onnxscript ORT fusion rewrites that fired (summed over groups; ORT's own optimizer then",
        "runs at level 'all'), and the most frequent ops left to PyTorch. executor='ort',",
        f"max_group_args={a.max_group_args}. *Weights frozen*: parameters and buffers that inference",
        "sessions hold as ORT initializers (kept: those that stayed inputs). *Widest group*: the most",
        "session inputs plus outputs of one group, what max_group_args limits (frozen weights do not count).",
        "",
        "| model | run | graphs | ORT groups | ATen nodes in ORT | weights frozen (kept) | widest group "
        "| ORT fusions fired | left to PyTorch |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    print("\n".join(lines[-2:]), flush=True)
    whole, split = [], []
    for name in a.models.split(","):
        for run, train in (("infer1", False), ("train", True)):
            p = partition(name, train, a.max_group_args)
            if not train:
                (whole if p["graphs"] == 1 and p["groups"] == 1 and p["ort"] == p["total"] else split).append(name)
            line = (
                f"| {name} | {run} | {p['graphs']} | {p['groups']} | {p['ort']}/{p['total']} "
                f"({100 * p['ort'] / max(p['total'], 1):.1f}%) | {p['frozen']} ({p['kept']}) | {p['widest']} "
                f"| {p['fusions']} | {p['left']} |"
            )
            lines.append(line)
            print(line, flush=True)
    lines += ["", one_group_note(whole, split)]
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


def one_group_note(whole: list, split: list) -> str:
    """What keeps inference graphs from one ORT group (issue 13 asks it of the models whose
    whole-model export fails, GPT-2 and Llama: benchmarks/results/speed.md)."""
    text = (
        f"Inference: {len(whole)} of {len(whole) + len(split)} models run as one Dynamo graph and one ORT "
        f"group with every ATen node in ORT ({', '.join(whole) or 'none'})."
    )
    exported_fails = [m for m in ("gpt2", "llama") if m in whole]
    if exported_fails:
        text += (
            f" {' and '.join(exported_fails)}, whose whole-model export fails on the DynamicCache output "
            "(benchmarks/results/speed.md), are among them: nothing keeps them from one group."
        )
    if split:
        text += f" More than one group or graph: {', '.join(split)} (see the columns above for why)."
    return text


if __name__ == "__main__":
    sys.exit(main())
