"""The same model exported whole to ONNX Runtime: the reference for lort's inference (issue 13).

``whole_ort_step(model, args, device)`` exports the model with
``torch.onnx.export(model, args, dynamo=True)`` (weights as initializers, the exporter's
default optimization; the ModelProto is serialized in memory and any artifacts go to a
temporary directory that is removed), builds an ``onnxruntime.InferenceSession`` at
ORT_ENABLE_ALL with intra-op threads = torch.get_num_threads() on the CPU provider (the
CUDA provider on a CUDA device), and returns a ``step()`` that runs it. The session
options otherwise match lort's own (runtime/session.py): one inter-op thread, sequential
execution, threads spinning within a run and stopped when it returns, so the comparison
differs in the graph ORT is given (whole, with constant weights) and not in how its threads wait.

The step runs through an IOBinding over the torch tensors' own memory, as lort does: the
inputs are bound once (the benchmark calls it on the same tensors every time), and each
call allocates its outputs with torch.empty and binds them, so no input is copied and the
step returns fresh torch tensors, like eager and lort. Before it is returned, the step's
first output is checked against eager's (``output_tensor`` of the model's output,
torch.testing.assert_close, rtol 1e-3 and atol 1e-4 for float32): a wrong model is never
timed. Any failure (export, session, binding or mismatch) returns a string instead of a
step, e.g. "export fails: <first line of the error>".
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import tempfile
from typing import Callable

import onnx
import onnxruntime as ort
import torch

from lort.runtime import cuda
from lort.testing.models import output_tensor
from report import geomean

_ELEMENT_TYPES = {
    torch.float32: 1, torch.uint8: 2, torch.int8: 3, torch.int16: 5, torch.int32: 6, torch.int64: 7,
    torch.bool: 9, torch.float16: 10, torch.float64: 11, torch.bfloat16: 16,
}
_ORT_TYPES = {
    "tensor(float)": torch.float32, "tensor(double)": torch.float64, "tensor(float16)": torch.float16,
    "tensor(bfloat16)": torch.bfloat16, "tensor(int64)": torch.int64, "tensor(int32)": torch.int32,
    "tensor(int16)": torch.int16, "tensor(int8)": torch.int8, "tensor(uint8)": torch.uint8,
    "tensor(bool)": torch.bool,
}
#: benchmarks/run.py's name for it, in a row's times.
WHOLE = "ort_whole"
# torch.testing.assert_close's defaults for the other dtypes; float32 as the brief of issue 13.
_TOLERANCES = {torch.float32: dict(rtol=1e-3, atol=1e-4)}


def _first_line(e: BaseException) -> str:
    """The first line of the innermost cause (torch.onnx wraps torch.export's error in a
    page of advice), without terminal colours."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {line[:200]}"


def export_bytes(model: torch.nn.Module, args: tuple) -> bytes:
    """The model exported whole by torch.onnx.export(dynamo=True), serialized in memory
    (raises what the exporter raises). The exporter's progress prints are swallowed."""
    with tempfile.TemporaryDirectory(prefix="lort_whole_ort_") as tmp, contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
        level = logging.getLogger("torch.onnx").level
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        stack.callback(logging.getLogger("torch.onnx").setLevel, level)
        with torch.no_grad():
            program = torch.onnx.export(
                model, args, dynamo=True, external_data=False, verbose=False, report=False, artifacts_dir=tmp,
            )
        return program.model_proto.SerializeToString()


def _tf32_kinds(model_bytes: bytes) -> frozenset:
    ops = {n.op_type for n in onnx.load_from_string(model_bytes).graph.node}
    kinds = set()
    if ops & {"Conv", "ConvTranspose"}:
        kinds.add(cuda.CUDNN)
    if ops & {"MatMul", "Gemm", "Einsum"}:
        kinds.add(cuda.MATMUL)
    return frozenset(kinds)


def session_options(spinning: bool = True) -> ort.SessionOptions:
    """The whole export's session options: lort's own thread settings (below)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "1" if spinning else "0")
    so.add_session_config_entry("session.force_spinning_stop", "1")  # as lort's Options.force_spinning_stop
    return so


def make_session(model_bytes: bytes, device: str = "cpu", spinning: bool = True) -> ort.InferenceSession:
    so = session_options(spinning)
    if torch.device(device).type == "cuda":
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        # TF32 as PyTorch's flags say for the kinds of work the model has, as lort decides
        # it for a group (lort/runtime/cuda.py: tf32_enabled).
        tf32 = "1" if cuda.tf32_enabled(_tf32_kinds(model_bytes)) else "0"
        providers = [("CUDAExecutionProvider", {"device_id": str(index), "use_tf32": tf32})]
    else:
        providers = ["CPUExecutionProvider"]
    return ort.InferenceSession(model_bytes, sess_options=so, providers=providers)


def _bound_step(session: ort.InferenceSession, args: tuple, device: torch.device) -> Callable[[], list]:
    """A step running ``session`` on ``args`` through an IOBinding over their memory."""
    inputs = [a.contiguous() for a in args if isinstance(a, torch.Tensor)]
    names = [i.name for i in session.get_inputs()]
    if len(names) != len(inputs):
        raise ValueError(f"the exported graph takes {len(names)} inputs, the model {len(inputs)} tensors")
    dev_type = "cuda" if device.type == "cuda" else "cpu"
    dev_id = (device.index if device.index is not None else torch.cuda.current_device()) if dev_type == "cuda" else 0
    binding = session.io_binding()
    for name, t in zip(names, inputs):
        binding.bind_input(name, dev_type, dev_id, _ELEMENT_TYPES[t.dtype], tuple(t.shape), t.data_ptr())
    outputs = []
    for o in session.get_outputs():
        if o.type not in _ORT_TYPES or not all(isinstance(d, int) for d in o.shape):
            raise ValueError(f"output {o.name} has type {o.type} and shape {o.shape}: not static")
        outputs.append((o.name, _ORT_TYPES[o.type], tuple(o.shape)))

    def step():
        results = []
        for name, dtype, shape in outputs:
            out = torch.empty(shape, dtype=dtype, device=device)
            binding.bind_output(name, dev_type, dev_id, _ELEMENT_TYPES[dtype], shape, out.data_ptr())
            results.append(out)
        session.run_with_iobinding(binding)
        return results

    step.inputs = inputs  # the bound memory lives as long as the step
    return step


def whole_ort_step(model: torch.nn.Module, args: tuple, device: str = "cpu",
                   spinning: bool = True) -> Callable[[], list] | str:
    """A step running ``model`` (in eval mode) on ``args`` exported whole to ORT, checked
    against eager once; or why not: "export fails: ...", "session fails: ...",
    "binding fails: ..." or "wrong output: ..."."""
    try:
        model_bytes = export_bytes(model, args)
    except Exception as e:  # noqa: BLE001 - reported in the table
        return f"export fails: {_first_line(e)}"
    try:
        session = make_session(model_bytes, device, spinning)
    except Exception as e:  # noqa: BLE001 - reported in the table
        return f"session fails: {_first_line(e)}"
    del model_bytes
    try:
        step = _bound_step(session, args, torch.device(device))
        got = step()[0]
    except Exception as e:  # noqa: BLE001 - reported in the table
        return f"binding fails: {_first_line(e)}"
    with torch.no_grad():
        want = output_tensor(model(*args))
    try:
        torch.testing.assert_close(got, want, **_TOLERANCES.get(want.dtype, {}))
    except AssertionError as e:
        detail = " ".join(l.strip() for l in str(e).splitlines()[:3] if l.strip())
        return f"wrong output: {detail[:200]}"
    return step


WHOLE_TEXT = [
    "Whole ORT: the same model exported whole (torch.onnx.export(dynamo=True), weights as initializers)",
    "and run in one ORT session at ORT_ENABLE_ALL with lort's thread settings (torch's thread count,",
    "spinning within a run), through an IOBinding over the inputs' memory as lort binds them, outputs allocated by torch",
    "each call (benchmarks/whole_ort.py); inference only, timed in the same round-robin, checked against",
    "eager before timing. lort vs whole ORT = whole ORT time / lort time; \"export fails\" (or \"wrong",
    "output\") where it could not run, with the reason under the table.",
]


# The columns and summary it adds to benchmarks/run.py's table. A row's "whole" is None
# where it was timed (times[WHOLE]), the reason where it could not run, "-" for training.


def whole_cells(row) -> str:
    """The whole-model ORT columns: its time and lort's speed-up over it, or why not
    ("export fails", ...: the reason in full is listed under the table)."""
    t = row["times"]
    if WHOLE in t and "lort" in t:
        return f"{t[WHOLE] * 1e3:9.3f} | {t[WHOLE] / t['lort']:6.2f}x"
    if WHOLE in t:
        return f"{t[WHOLE] * 1e3:9.3f} | -"
    why = row.get("whole") or "-"
    return f"{why.split(':')[0]} | -"


def whole_notes(rows) -> list[str]:
    """Why the model could not run whole in ORT, per row where it could not."""
    return [f"- whole-model ORT, {r['model']} {r['scenario']}: {r['whole']}" for r in rows
            if r.get("whole") not in (None, "-")]


def whole_summary(sel) -> str:
    """", {x}x over whole-model ORT (n of m models)" for inference rows, the geomean over
    the models that ran whole; "" for training rows."""
    inference = [r for r in sel if r.get("whole") != "-" and "whole" in r]
    if not inference:
        return ""
    ran = [r for r in inference if WHOLE in r["times"]]
    if not ran:
        return f", whole-model ORT: none of {len(inference)} models export whole"
    gw = geomean([r["times"][WHOLE] / r["times"]["lort"] for r in ran])
    return f", {gw:.2f}x over whole-model ORT ({len(ran)} of {len(inference)} models export whole)"


if __name__ == "__main__":  # which benchmark models export whole: python benchmarks/whole_ort.py [models]
    import sys

    from lort.testing.models import CASES, make_torchvision_importable

    make_torchvision_importable()
    for name in (sys.argv[1].split(",") if len(sys.argv) > 1 else CASES):
        for batch in (1, 8):
            m, a = CASES[name].make(batch, seed=0)
            r = whole_ort_step(m.eval(), a)
            print(f"{name} batch {batch}: {'exports whole, matches eager' if callable(r) else r}", flush=True)
