"""A group whose ORT session fails when it runs (not when it is built) falls back like
one that fails to build: an ORT-fused model that fails goes back to the plain
translation; a plain model that fails runs in PyTorch from then on, with one warning
naming its ops and the error, or SessionRunError with fallback="raise". Results are
checked against eager. Also the FusedMatMul rank guard on onnxscript's rewrite rules,
whose unguarded rewrite is one such run-time failure."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import lort
from lort.backend import LortBackend
from lort.runtime import session as session_mod
from lort.translate import onnx_export


def f(x, w):
    return torch.relu(torch.matmul(x, w)) * 2.0


def inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 5, 3, generator=g), torch.randn(3, 6, generator=g)


def test_fused_matmul_batch_rule_keeps_ranks_ort_can_run():
    """FusedMatMul(Transpose(z, perm=[1, 2, 0]), y, transA=1) with y of rank 2: onnxscript
    0.7.2 rewrites it to transBatchA=1, which ORT refuses at run time for inputs of
    different ranks. With lort's guard the rewrite does not fire and the model runs."""
    nodes = [
        helper.make_node("Transpose", ["z"], ["t"], perm=[1, 2, 0]),
        helper.make_node("FusedMatMul", ["t", "y"], ["out"], domain="com.microsoft", transA=1),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 5, 3]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 6])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [5, 4, 6])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    rng = np.random.default_rng(0)
    feeds = {"z": rng.standard_normal((4, 5, 3), dtype=np.float32), "y": rng.standard_normal((3, 6), dtype=np.float32)}
    want = np.einsum("bmk,kn->mbn", feeds["z"], feeds["y"])  # (z permuted to [5,3,4])^T @ y
    fused, _ = onnx_export.fuse_for_ort(ir.from_proto(model))
    assert fused is not None
    for node in onnx.load_from_string(fused).graph.node:
        attrs = {a.name: a.i for a in node.attribute}
        assert not attrs.get("transBatchA") and not attrs.get("transBatchB"), node
    got = ort.InferenceSession(fused, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _broken_fusion(model: ir.Model, in_place: bool = False, serializer=None, skip_norms: bool = True):
    """A fused model ORT builds but cannot run: MatMul made a FusedMatMul with
    transBatchA=1 on inputs of rank 3 and 2 (what the unguarded rewrite produced)."""
    proto = ir.serde.serialize_model(model)
    matmuls = [n for n in proto.graph.node if n.op_type == "MatMul"]
    assert matmuls, "the group has a MatMul"
    for n in matmuls:
        n.op_type, n.domain = "FusedMatMul", "com.microsoft"
        n.attribute.append(helper.make_attribute("transBatchA", 1))
    proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    if serializer is not None:  # fuse_for_ort's contract: the model as the serializer gives it
        return serializer(ir.serde.deserialize_model(proto)), {"broken_fusion": len(matmuls)}
    return proto.SerializeToString(), {"broken_fusion": len(matmuls)}


def test_fused_model_failing_at_first_run_falls_back_to_the_plain_one(monkeypatch):
    monkeypatch.setattr(onnx_export, "fuse_for_ort", _broken_fusion)
    check_plain_model_runs(*inputs())


def check_plain_model_runs(x, w):
    """With fuse_for_ort patched to give a model that fails at its first run: the plain
    model runs, with no warning, on both calls (tests/cuda/test_cuda.py runs it on CUDA)."""
    backend = LortBackend({"executor": "ort", "fallback": "raise"})
    before = lort.stats.ort_runs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the plain model runs: nothing to warn about
        got = torch.compile(f, backend=backend)(x, w)
        again = torch.compile(f, backend=backend)(x, w)
    torch.testing.assert_close(got, f(x, w), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(again, f(x, w), rtol=1e-5, atol=1e-6)
    (group,) = backend.records[0].group_modules.values()
    assert group.executor == "ort" and group.fusions == {} and group.run_failure is None
    assert lort.stats.ort_runs - before >= 2


def _failing_run(calls, message="[ONNXRuntimeError] : 1 : FAIL : simulated kernel failure"):
    def run(self, args):
        calls.append(self.name)
        raise RuntimeError(message)

    return run


def test_session_failing_at_run_time_runs_the_group_in_pytorch_with_one_warning(monkeypatch):
    calls: list = []
    monkeypatch.setattr(session_mod.GroupSession, "run", _failing_run(calls))
    x, w = inputs()
    backend = LortBackend({"executor": "ort", "ort_fusions": False})
    compiled = torch.compile(f, backend=backend)
    with pytest.warns(UserWarning, match=r"ORT failed to run group .*aten\.(mm|matmul|bmm|view).*simulated kernel failure"):
        got = compiled(x, w)
    torch.testing.assert_close(got, f(x, w), rtol=1e-5, atol=1e-6)
    assert len(calls) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once; the broken session is not run again
        x2 = torch.randn(4, 5, 3)
        torch.testing.assert_close(compiled(x2, w), f(x2, w), rtol=1e-5, atol=1e-6)
    assert len(calls) == 1
    record = backend.records[0]
    (group,) = record.group_modules.values()
    assert group.executor == "pytorch" and "simulated kernel failure" in group.run_failure
    assert not group.sessions
    # explain's record says where the group runs now, and why.
    assert record.groups[0].executor == "pytorch" and record.ort_nodes == 0
    assert record.torch_nodes == record.groups[0].num_nodes > 0
    assert all("ORT failed to run its group" in why for _, why in record.fallbacks)


def test_session_failing_at_run_time_raises_with_fallback_raise(monkeypatch):
    monkeypatch.setattr(session_mod.GroupSession, "run", _failing_run([]))
    x, w = inputs()
    compiled = torch.compile(f, backend=LortBackend({"executor": "ort", "fallback": "raise", "ort_fusions": False}))
    with pytest.raises(lort.SessionRunError, match="ORT failed to run group") as info:
        compiled(x, w)
    assert isinstance(info.value, lort.SessionCreationError)


def test_disk_cache_remembers_a_run_failure(monkeypatch, tmp_path):
    """A new process (here: a fresh backend after dynamo.reset) reads the failure from
    the disk cache: the group runs in PyTorch without trying ORT again, and the record
    says why."""
    calls: list = []
    monkeypatch.setattr(session_mod.GroupSession, "run", _failing_run(calls))
    opts = {"executor": "ort", "ort_fusions": False, "disk_cache": True, "cache_dir": str(tmp_path)}
    x, w = inputs()
    with pytest.warns(UserWarning, match="ORT failed to run group"):
        torch.compile(f, backend=LortBackend(opts))(x, w)
    assert len(calls) == 1
    torch._dynamo.reset()
    backend = LortBackend(opts)
    # Said again in the new process, which would otherwise run the group in PyTorch
    # with nothing to say why.
    with pytest.warns(UserWarning, match=r"runs in PyTorch: ORT failed to run it in an earlier process "
                                         r"\(.*simulated kernel failure\).*disk_cache=False"):
        got = torch.compile(f, backend=backend)(x, w)
    torch.testing.assert_close(got, f(x, w), rtol=1e-5, atol=1e-6)
    assert len(calls) == 1  # not run in ORT again
    record = backend.records[0]
    (group,) = record.group_modules.values()
    assert group.from_cache and group.executor == "pytorch" and "simulated kernel failure" in group.run_failure
    assert record.ort_nodes == 0 and record.torch_nodes > 0
    assert all("ORT failed to run its group" in why and "simulated" in why for _, why in record.fallbacks)


def test_disk_cache_does_not_keep_a_failure_for_want_of_memory(monkeypatch, tmp_path):
    """ORT running out of memory is a failure of the moment, not of the group: this
    process runs the group in PyTorch, but a new one tries ORT again (and here, with
    memory free, runs it there)."""
    calls: list = []
    oom = ("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running "
           "MatMul node. Name:'n0' Status Message: Failed to allocate memory for requested buffer of size 4096")
    monkeypatch.setattr(session_mod.GroupSession, "run", _failing_run(calls, oom))
    opts = {"executor": "ort", "ort_fusions": False, "disk_cache": True, "cache_dir": str(tmp_path)}
    x, w = inputs()
    with pytest.warns(UserWarning, match="Failed to allocate memory"):
        got = torch.compile(f, backend=LortBackend(opts))(x, w)
    torch.testing.assert_close(got, f(x, w), rtol=1e-5, atol=1e-6)
    assert len(calls) == 1
    torch._dynamo.reset()
    monkeypatch.undo()  # the new process has its memory
    backend = LortBackend(opts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = torch.compile(f, backend=backend)(x, w)
    torch.testing.assert_close(got, f(x, w), rtol=1e-5, atol=1e-6)
    (group,) = backend.records[0].group_modules.values()
    assert group.from_cache and group.executor == "ort" and group.run_failure is None
    assert backend.records[0].ort_nodes > 0
