"""Where a first call's time goes, stage by stage, at the sizes users run.

For each (case, front end) a fresh process with an empty lort disk cache builds the model
(lort.testing.models.SCALE_CASES: BERT-base inference and training, the 0.92B Llama-style
decoder's inference) and makes one call, with a timer around each of lort's stages
(then a second process over the caches the first filled: the warm first call):

- **capture**: what is left of the first call once lort's backend call and the
  whole-graph timing are taken out: Dynamo's trace and AOTAutograd (torch.compile), or
  ``torch.export`` (ORTModule's direct inference, timed on its own);
- **translate**: torch_lib's translation of each group to ONNX and its serialization;
- **rewrite**: onnxscript's ORT fusion rewrites (``fuse_for_ort``);
- **session**: building the groups' ORT sessions;
- **group timing**: ORT threads and ORT against PyTorch per group;
- **whole-graph timing**: lort's graph against eager PyTorch on the first call;
- **other lort**: the rest of lort's graph compile (support check, fusion, weights).

Stages nest in lort's code; each column is exclusive of the others.

    python benchmarks/studies/first_call_stages.py [--cases bert_base:infer,...] [--fronts lort,ortmodule]

Writes the ``stages`` section of benchmarks/studies/first_call_stages.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this study's folder, then benchmarks/ (the shared modules)
from report import machine_line, write_section  # noqa: E402
from scale import run_child  # noqa: E402

CASES = ["bert_base:infer", "bert_base:train", "llama_2gb:infer"]
FRONTS = ["lort", "ortmodule"]

CHILD = r"""
import collections, functools, json, sys, time
import torch
from lort.testing.models import SCALE_CASES, make_torchvision_importable, output_tensor
make_torchvision_importable()
import transformers, lort, onnxruntime, onnxscript, torch._dynamo
from lort import backend as backend_mod
from lort.compile import graph_compiler, group_compiler, tuner as tuner_mod
from lort.module import direct
from lort.translate import onnx_export

T = collections.Counter()
STACK = []  # [child seconds] of the timed regions open now: each label gets its own time only


def wrap(owner, attr, label):
    f = getattr(owner, attr)

    @functools.wraps(f)
    def timed(*a, **k):
        STACK.append(0.0)
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            elapsed = time.perf_counter() - t0
            T[label] += elapsed - STACK.pop()
            if STACK:
                STACK[-1] += elapsed
    setattr(owner, attr, timed)


wrap(onnx_export, "translate_group", "translate")
wrap(onnx_export, "serialize", "translate")
wrap(onnx_export, "fuse_for_ort", "rewrite")
wrap(onnx_export, "_fuse_runs", "rewrite")
wrap(group_compiler, "GroupSession", "session")
wrap(group_compiler.GroupCompiler, "_choose_threads", "group timing")
wrap(group_compiler.GroupCompiler, "_choose_executor", "group timing")
wrap(graph_compiler.GraphCompiler, "compile", "lort compile")
wrap(backend_mod.LortBackend, "__call__", "backend")
wrap(tuner_mod.Tuner, "time_graph", "whole-graph timing")
wrap(direct, "export_inference", "export")

case, task, front = sys.argv[2], sys.argv[3], sys.argv[4]
train = task == "train"
model, args, kwargs = SCALE_CASES[case]()
model.train(train)
fn = torch.compile(model, backend="lort") if front == "lort" else lort.ORTModule(model)
t0 = time.perf_counter()
if train:
    out = fn(*args, **kwargs)
    loss = out.loss if getattr(out, "loss", None) is not None else output_tensor(out).float().pow(2).mean()
    loss.backward()
else:
    with torch.no_grad():
        fn(*args, **kwargs)
total = time.perf_counter() - t0
# Each label holds its own time (nested regions taken out); the rest of the call is
# capture: Dynamo and AOTAutograd (inside lort's backend call too), or torch.export.
lort_own = sum(v for k, v in T.items() if k not in ("backend", "export"))
other = T["lort compile"]
capture = total - lort_own
print(json.dumps({"total": total, "capture": capture, "export": T["export"], "translate": T["translate"],
                  "rewrite": T["rewrite"], "session": T["session"], "group timing": T["group timing"],
                  "whole-graph timing": T["whole-graph timing"], "other lort": other}))
"""

COLUMNS = ["capture", "translate", "rewrite", "session", "group timing", "whole-graph timing", "other lort"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--fronts", default=",".join(FRONTS))
    ap.add_argument("--out", default=os.path.join(HERE, "first_call_stages.md"))
    a = ap.parse_args(argv)
    lines = ["| case | front end | first call s | " + " | ".join(f"{c} s" for c in COLUMNS)
             + " | warm first call s | warm / cold |", "|---|---|---:|" + "---:|" * len(COLUMNS) + "---:|---:|"]
    for spec in a.cases.split(","):
        case, task = spec.split(":")
        for front in a.fronts.split(","):
            # Cold (empty caches), then a second process over the caches the first filled.
            with tempfile.TemporaryDirectory(prefix="lort-stages-") as caches:
                r = run_child(CHILD, case, task, front, cache_dir=caches)
                warm = run_child(CHILD, case, task, front, cache_dir=caches) if "error" not in r else {}
            print(spec, front, r, "warm:", warm.get("total"), flush=True)
            if "error" in r:
                lines.append(f"| {spec} | {front} | failed: {r['error']} |" + " |" * (len(COLUMNS) + 2))
                continue
            cells = " | ".join(f"{r[c]:.1f}" for c in COLUMNS)
            w = warm.get("total")
            tail = f"{w:.1f} | {w / r['total']:.2f}" if w else f"failed: {warm.get('error', '')} |"
            lines.append(f"| {spec} | {front} | {r['total']:.1f} | {cells} | {tail} |")
    stamp = f"Taken {datetime.date.today()} by `python benchmarks/studies/first_call_stages.py {' '.join(argv or sys.argv[1:])}`."
    write_section(a.out, "stages", [stamp, machine_line(), "", *lines],
                  title="# Where a first call's time goes, stage by stage")


if __name__ == "__main__":
    main()
