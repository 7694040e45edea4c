"""translate/external_data.py and runtime/session.py's shared initializers: a frozen
model's bytes hold no weight, ORT reads the weights from their own memory, and
save_onnx writes them as ONNX external data."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch

import lort
from lort.runtime.session import create_session
from lort.translate import external_data


def _model(weight: np.ndarray, bias: np.ndarray) -> ir.Model:
    """y = x @ W^T + b, with W and b initializers holding the arrays (no copy)."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, weight.shape[1]]))
    w = ir.Value(name="w", const_value=ir.Tensor(weight, name="w"))
    b = ir.Value(name="b", const_value=ir.Tensor(bias, name="b"))
    node = ir.node("Gemm", [x, w, b], attributes={"transB": 1})
    node.outputs[0].name = "y"
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=[w, b], opset_imports={"": 18})
    return ir.Model(graph, ir_version=10)


def test_serialize_keeps_large_initializers_out_of_the_bytes():
    weight = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32)
    bias = np.ones(16, np.float32)  # 64 bytes: stays in the bytes
    ir_model = _model(weight, bias)
    model = external_data.serialize(ir_model)
    assert len(model.proto) < 4_000 < weight.nbytes
    ((name, tensor, onnx_type),) = model.external
    assert name == "w" and onnx_type == onnx.TensorProto.FLOAT
    assert tensor.data_ptr() == weight.ctypes.data  # the array's own memory
    inits = {t.name: t for t in onnx.ModelProto.FromString(model.proto).graph.initializer}
    assert inits["w"].data_location == onnx.TensorProto.EXTERNAL
    assert inits["b"].data_location != onnx.TensorProto.EXTERNAL
    assert ir_model.graph.initializers["w"].const_value.numpy() is weight  # the model is left as it was


def test_ort_reads_shared_initializers_in_place():
    """The session computes with the weight's own memory: a write to it shows in the
    next run (Gemm's bias is not pre-packed: read in place each run)."""
    rng = np.random.default_rng(0)
    weight = torch.from_numpy(rng.standard_normal((64, 32)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(64).astype(np.float32))
    model = external_data.serialize(_model(weight.numpy(), bias.numpy()), min_bytes=64)
    assert {e[0] for e in model.external} == {"w", "b"}
    sess = create_session(model, torch.device("cpu"), lort.Options(), "test", 1, count=False)
    x = rng.standard_normal((2, 32)).astype(np.float32)
    (y,) = sess.run(None, {"x": x})
    np.testing.assert_allclose(y, x @ weight.numpy().T + bias.numpy(), rtol=1e-5, atol=1e-5)
    bias.add_(10.0)
    (y2,) = sess.run(None, {"x": x})
    np.testing.assert_allclose(y2, y + 10.0, rtol=1e-5, atol=1e-4)


def test_ort_folds_shared_initializers_with_their_real_values():
    """ORT's optimizer folds what it can from the initializers' real values (not from
    a placeholder of zeros): Transpose(W) folded, then multiplied."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((32, 16)).astype(np.float32)
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 16]))
    w = ir.Value(name="w", const_value=ir.Tensor(weight, name="w"))
    t = ir.node("Transpose", [w], attributes={"perm": [1, 0]})
    mm = ir.node("MatMul", [x, t.outputs[0]])
    mm.outputs[0].name = "y"
    graph = ir.Graph([x], mm.outputs, nodes=[t, mm], initializers=[w], opset_imports={"": 18})
    model = external_data.serialize(ir.Model(graph, ir_version=10))
    sess = create_session(model, torch.device("cpu"), lort.Options(), "test", 1, count=False)
    xs = rng.standard_normal((2, 16)).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": xs})[0], xs @ weight.T, rtol=1e-5, atol=1e-5)


def test_save_writes_external_data_onnx_and_ort_load(tmp_path):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((64, 32)).astype(np.float32)
    bias = rng.standard_normal(64).astype(np.float32)
    model = external_data.serialize(_model(weight, bias), min_bytes=64)
    path = str(tmp_path / "g.onnx")
    external_data.save(model, path)
    assert (tmp_path / "g.onnx.data").stat().st_size >= weight.nbytes + bias.nbytes
    loaded = onnx.load(path)
    values = {t.name: onnx.numpy_helper.to_array(t) for t in loaded.graph.initializer}
    np.testing.assert_array_equal(values["w"], weight)
    np.testing.assert_array_equal(values["b"], bias)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((2, 32)).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], x @ weight.T + bias, rtol=1e-5, atol=1e-5)


def test_save_onnx_of_a_frozen_group_loads_with_its_weights(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).eval()
    x = torch.randn(4, 64)
    cm = torch.compile(model, backend="lort", options={"save_onnx": str(tmp_path), "executor": "ort"})
    with torch.no_grad():
        expected = cm(x)
    (path,) = tmp_path.glob("*.onnx")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert len(sess.get_inputs()) == 1  # the weights are its initializers, from path.data
    (y,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(y, expected.numpy(), rtol=1e-5, atol=1e-5)


def test_the_fusion_rewrites_fold_no_large_constant(tmp_path):
    """onnxscript's optimizer (inside the ORT fusion rewrites) materialized BERT's
    attention-mask zeros_like as a constant of the mask's size (12 x 768 KiB in BERT-base,
    held in the model bytes and in ORT's session); lort's limit keeps such constants
    computed at run time."""
    from lort.translate import _compat

    def f(x, mask):
        return torch.where(mask, x, torch.zeros_like(x)).softmax(-1)

    x, mask = torch.randn(1, 12, 128, 128), torch.rand(1, 1, 128, 128) > 0.5
    compiled = torch.compile(f, backend="lort", options={"executor": "ort", "save_onnx": str(tmp_path), "disk_cache": False})
    torch.testing.assert_close(compiled(x, mask), f(x, mask))
    (path,) = tmp_path.glob("*.onnx")
    sizes = [int(np.prod(t.dims)) for t in onnx.load(str(path), load_external_data=False).graph.initializer]
    assert max(sizes, default=0) <= _compat.FOLD_OUTPUT_SIZE_LIMIT < x.numel(), sizes
    torch._dynamo.reset()
