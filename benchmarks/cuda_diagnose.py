"""Diagnoses for the CUDA failures tests/cuda/test_cuda.py left open on an H200 (2026-11-26),
for the next session with a GPU (`bash benchmarks/gpu_run.sh diagnose`). Prints, never
asserts; stderr is not captured, so ORT's own message before an abort shows.

- ``precision``: the 'transformer' model's inference error against float64 (eager's was
  1.67e-06, lort's 1.65e-04 with ORT's fused model refused and the plain one run) under
  lort's defaults, with ``ort_fusions=False``, with ORT's optimizer at 'basic' too (its
  attention and other fusions on CUDA are not the CPU's), with ORT's CUDA
  SkipLayerNormalization in ORT's default mode (one-pass variance, E[x^2] - mean^2; lort
  now asks for strict mode, runtime/cuda.py), and with TF32 flags on, beside what ORT's
  optimizer changed in each group; then eager without the MHA fast path and the graph
  through aot_eager, inductor and lort's mode='pytorch' (the fourth run saw the same error
  with no ORT group at all).
- ``by_op``: the same model with one ATen op at a time in ORT, the rest in PyTorch: the
  error each op's ORT kernels bring (the second GPU run ruled out every fusion and the
  SkipLayerNormalization mode; the plain graph carries it).
- ``release``: 'vit' forward and backward, then the model dropped (lort releases its
  sessions): the process aborted inside that release. Each stage is printed before it
  runs, with a device synchronize between stages. It passed in the second GPU run: the
  synchronizes let ORT's end-of-run host function run before the sessions were freed.
  The drain lort then added (runtime/cuda.py: drain) did not end the abort (third run);
  tests/cuda/test_cuda.py's test_model_dropped_while_its_last_run_is_queued is the
  failing case.
- ``pinned``: what Options.cuda_pinned_memory="process" (one pinned allocator in ORT's
  environment, no arena) costs and whether it ends the abort: for each setting, a fresh
  process times BERT and GPT-2 (lort.testing.models.CUDA_CASES) at batch 1 inference and
  batch 32 training through lort, drops each model right after a call queued behind
  long matmuls, and says whether the process got through.
"""

from __future__ import annotations

import argparse
import copy
import gc
import operator
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "tests", "models"))  # test_models
sys.path.insert(0, _HERE)  # run.py, timing.py


def _stage(text: str) -> None:
    print(f"-- {text}", flush=True)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref).abs().max().item()


def _model_and_reference(name: str, device: str):
    """tests/models/test_models.py's ``name`` in eval mode, its inputs, and its output in float64
    and in eager float32."""
    from lort.testing.models import output_tensor
    from test_models import make

    model, args = make(name, seed=1, device=device)
    model.eval()
    with torch.no_grad():
        ref = output_tensor(copy.deepcopy(model).double()(*[a.double() if a.is_floating_point() else a
                                                            for a in args]))
        eager = output_tensor(model(*args))
    return model, args, ref, eager


def precision(name: str, device: str) -> None:
    import lort
    from lort import LortBackend
    from lort.diagnostics.records import ort_optimizer_text
    from lort.testing.models import output_tensor
    model, args, ref, eager = _model_and_reference(name, device)
    print(f"{name}: eager error {_err(eager, ref):.3g} (scale {ref.abs().max().item():.3g})", flush=True)
    for label, options, tf32 in (("defaults", {}, False), ("ort_fusions=False", {"ort_fusions": False}, False),
                                 ("ORT's optimizer at 'basic' (no ORT fusions)",
                                  {"ort_fusions": False, "graph_optimization_level": "basic"}, False),
                                 ("ORT's CUDA SkipLayerNormalization in its default (not strict) mode",
                                  {"providers": (("CUDAExecutionProvider", {"enable_skip_layer_norm_strict_mode": "0"}),
                                                 "CPUExecutionProvider")}, False),
                                 ("TF32 on (matmul and cuDNN)", {}, True)):
        torch._dynamo.reset()
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        backend = LortBackend(lort.Options(record_ort_graph=True, executor="ort", **options))
        with torch.no_grad():
            out = output_tensor(torch.compile(copy.deepcopy(model), backend=backend)(*args))
            eager_now = output_tensor(model(*args))
        print(f"{name} [{label}]: lort error {_err(out, ref):.3g}, eager {_err(eager_now, ref):.3g}", flush=True)
        for record in backend.records:
            for group in record.groups:
                print(f"   group {group.name}: {group.num_nodes} nodes, in {group.executor.value}, "
                      f"fusions {dict(group.fusions)}\n   ORT optimizer: {ort_optimizer_text(group.ort_optimizer)}",
                      flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True
    # The fourth GPU run found the gap with no ORT group at all: is it PyTorch's own
    # running of the captured graph (eager takes nn.TransformerEncoderLayer's fused fast
    # path, a compiled graph its decomposed ops)?
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    with torch.no_grad():
        plain = output_tensor(model(*args))
    torch.backends.mha.set_fastpath_enabled(fastpath)
    print(f"{name} [eager without the MHA fast path]: error {_err(plain, ref):.3g}", flush=True)
    for label, backend in (("torch.compile aot_eager", "aot_eager"), ("torch.compile inductor", "inductor"),
                           ("lort mode='pytorch'", LortBackend(lort.Options(mode="pytorch")))):
        torch._dynamo.reset()
        with torch.no_grad():
            out = output_tensor(torch.compile(copy.deepcopy(model), backend=backend)(*args))
        print(f"{name} [{label}]: error {_err(out, ref):.3g}", flush=True)


def by_op(name: str, device: str) -> None:
    """The model with one ATen op at a time in ORT (every other node in PyTorch, through a
    support check that refuses them): which op's ORT kernels carry the error."""
    import lort
    from lort import LortBackend
    from lort.fusion import support
    from lort.reasons import Reason, ReasonKind
    from lort.testing.models import output_tensor
    model, args, ref, eager = _model_and_reference(name, device)

    def run() -> tuple[float, LortBackend]:
        torch._dynamo.reset()
        backend = LortBackend(lort.Options(executor="ort", disk_cache=False))  # no plan from an earlier run
        with torch.no_grad():
            out = output_tensor(torch.compile(copy.deepcopy(model), backend=backend)(*args))
        return _err(out, ref), backend

    err, backend = run()
    ops = sorted({op for r in backend.records for g in r.groups for op in g.ops})
    print(f"{name}: eager error {_err(eager, ref):.3g}; lort, every op in ORT: {err:.3g}; ops {ops}", flush=True)
    plain = support.SupportChecker.reason
    try:
        for op in ops:
            def only(self, node, op=op):
                why = plain(self, node)
                # getitem goes where its producer goes (a tuple never crosses a group's edge)
                if why is None and node.target is not operator.getitem and support.op_name(node) != op:
                    return Reason(ReasonKind.NOT_ATEN, f"diagnose: only {op} in ORT")
                return why

            support.SupportChecker.reason = only
            err, backend = run()
            placed = sum(1 for r in backend.records for g in r.groups)
            print(f"  only {op} in ORT ({placed} group(s)): lort error {err:.3g}", flush=True)
    finally:
        support.SupportChecker.reason = plain


def release(name: str, device: str) -> None:
    from lort.testing.models import output_tensor
    from test_models import loss_of, make

    _stage(f"{name}: build")
    model, args = make(name, device=device)
    cm = torch.compile(model, backend="lort")
    _stage("forward")
    out = output_tensor(cm(*args))
    _sync(device)
    _stage("backward")
    loss_of(out).backward()
    _sync(device)
    _stage("drop the output and gradients")
    del out
    model.zero_grad(set_to_none=True)
    gc.collect()
    _sync(device)
    _stage("drop the model (lort releases its sessions)")
    del cm, model
    gc.collect()
    _sync(device)
    _stage("released; Dynamo reset")
    torch._dynamo.reset()
    gc.collect()
    _sync(device)
    _stage("done")


def pinned(device: str, models: str | None, min_time: float) -> None:
    import subprocess

    for setting in ("session", "process"):
        _stage(f"cuda_pinned_memory={setting!r}, a fresh process")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "pinned_child", "--setting", setting,
                               "--device", device, "--min-time", str(min_time)] + (["--model", models] if models else []),
                              text=True)
        print(f"cuda_pinned_memory={setting!r}: exit status {proc.returncode}"
              f"{' (aborted)' if proc.returncode in (-6, 134) else ''}", flush=True)


def pinned_child(setting: str, device: str, models: str | None, min_time: float) -> None:
    import lort
    import timing
    from lort.testing.models import CUDA_CASES, output_tensor
    from run import CUDA_SCENARIOS

    big = torch.randn(4096, 4096, device=device) / 64
    for name in (models or "bert,gpt2").split(","):
        for scenario in ("infer1", "train32"):
            torch._dynamo.reset()
            kind, batch = CUDA_SCENARIOS[scenario]
            model, args = CUDA_CASES[name].make(batch, seed=0)
            model, args = model.to(device), tuple(a.to(device) for a in args)
            if kind == "inference":
                model.eval()
            fn = torch.compile(model, backend=lort.LortBackend({"cuda_pinned_memory": setting}))
            params = [p for p in model.parameters() if p.requires_grad]

            def step(args=args):
                if kind == "inference":
                    with torch.no_grad():
                        return fn(*args)
                for p in params:
                    p.grad = None
                out = output_tensor(fn(*args))
                out.float().pow(2).mean().backward()
                return out

            seconds = timing.timed_interleaved({"step": step}, min_time=min_time, repeats=7,
                                               sync=lambda: _sync(device))["step"]
            print(f"{name} {scenario} [{setting}]: {seconds * 1e3:.3f} ms", flush=True)
            y = big
            for _ in range(6):
                y = torch.tanh(y @ big)
            step()  # its ORT runs wait on the matmuls (lort's stream follows the current one by events)
            del fn, model, step, params
            gc.collect()
            torch._dynamo.reset()  # Dynamo's cache holds the module until then
            gc.collect()
            print(f"{name} {scenario} [{setting}]: dropped right after a queued call", flush=True)
    torch._dynamo.reset()
    gc.collect()
    _sync(device)
    print(f"[{setting}] released", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["precision", "by_op", "release", "pinned", "pinned_child"])
    ap.add_argument("--setting", default="session", help="pinned_child: Options.cuda_pinned_memory")
    ap.add_argument("--min-time", type=float, default=1.0,
                    help="pinned: seconds of timed calls per case (benchmarks/timing.py, 7 samples)")
    ap.add_argument("--model", default=None,
                    help="default: transformer (precision), vit (release), bert,gpt2 (pinned)")
    ap.add_argument("--device", default="cuda", help="cuda (what it is for), or cpu to try the script")
    a = ap.parse_args()
    if a.what == "precision":
        precision(a.model or "transformer", a.device)
    elif a.what == "by_op":
        by_op(a.model or "transformer", a.device)
    elif a.what == "release":
        release(a.model or "vit", a.device)
    elif a.what == "pinned":
        pinned(a.device, a.model, a.min_time)
    else:
        pinned_child(a.setting, a.device, a.model, a.min_time)
    return 0


if __name__ == "__main__":
    sys.exit(main())
