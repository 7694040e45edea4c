"""Options.quantize: frozen weight matrices quantized for inference (compile/quantize.py).

Exactness: lort's quantized model against eager PyTorch running the same model with each
weight matrix replaced by its dequantized values (quantized here with onnxruntime's
quantizer, dequantized here in NumPy from the packed blocks: an independent reading of
the format), so the only difference from eager is the quantization's own."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import lort
from lort.errors import QuantizationError, UnsupportedInputError
from lort.testing.models import gpt2, llama, output_tensor

BITS = {"int4": 4, "int8": 8}


def _dequantized(w_kn: np.ndarray, scheme: str, block: int, symmetric: bool) -> np.ndarray:
    """``w_kn`` [K, N] quantized by onnxruntime's quantizer as lort asks, then dequantized
    from its packed blocks: [K, N] float32."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    bits = BITS[scheme]
    quantizer = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
        block_size=block, is_symmetric=symmetric, bits=bits))
    packed, scales, zero_points = quantizer.qbits_block_quant(np.ascontiguousarray(w_kn, dtype=np.float32))
    k, n = w_kn.shape
    blocks = scales.shape[1]
    if bits == 4:  # two weights a byte, the first in the low nibble
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, blocks, block)
        zp = np.stack([zero_points & 0x0F, zero_points >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    else:
        q = packed.reshape(n, blocks, block)
        zp = zero_points[:, :blocks]
    if symmetric:
        zp = np.full((n, blocks), 1 << (bits - 1))
    w = (q.astype(np.float32) - zp[:, :, None].astype(np.float32)) * scales[:, :, None]
    return np.ascontiguousarray(w.reshape(n, blocks * block)[:, :k].T)


def _reference(model: torch.nn.Module, scheme: str, block: int, symmetric: bool) -> tuple[torch.nn.Module, int]:
    """A copy of ``model`` whose linear layers (and transformers' Conv1D) hold their
    dequantized weights, and how many it changed."""
    from transformers.pytorch_utils import Conv1D

    ref = copy.deepcopy(model)
    changed = 0
    with torch.no_grad():
        for module in ref.modules():
            if isinstance(module, torch.nn.Linear):
                w = _dequantized(module.weight.numpy().T, scheme, block, symmetric).T
            elif isinstance(module, Conv1D):  # GPT-2's: weight [K, N]
                w = _dequantized(module.weight.numpy(), scheme, block, symmetric)
            else:
                continue
            module.weight.copy_(torch.from_numpy(np.ascontiguousarray(w)))
            changed += 1
    return ref, changed


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 40, bias=False))
    return model, (torch.randn(3, 7, 64),)


MODELS = {
    "mlp": _mlp,
    "gpt2": lambda: gpt2(batch=2, seq=16, layers=2, hidden=64, heads=4),
    "llama": lambda: llama(batch=2, seq=16, layers=2, hidden=64, heads=4, kv_heads=2),
}


@pytest.mark.parametrize("scheme, symmetric", [("int4", False), ("int4", True), ("int8", False)])
@pytest.mark.parametrize("name", list(MODELS))
def test_quantized_model_matches_eager_with_the_dequantized_weights(name, scheme, symmetric, caplog):
    """accuracy_level=1 (MatMulNBits computes in float32): lort's output is eager's on the
    dequantized weights within float32's tolerances, and every weight matrix was
    quantized (the log counts the products); eager on the float32 weights differs by
    the quantization's own error, which the test reports."""
    import logging

    model, args = MODELS[name]()
    model.eval()
    block = 32
    ref, changed = _reference(model, scheme, block, symmetric)
    options = {"quantize": scheme, "quantize_block_size": block, "quantize_symmetric": symmetric,
               "quantize_accuracy_level": 1, "executor": "ort", "disk_cache": False}
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="lort"), torch.no_grad():
        out = output_tensor(torch.compile(copy.deepcopy(model), backend="lort", options=options)(*args))
        expected = output_tensor(ref(*args))
        eager = output_tensor(model(*args))
    torch.testing.assert_close(out, expected)
    quantized = sum(int(r.getMessage().split("quantized ")[1].split(" ")[0]) for r in caplog.records
                    if "product(s) to" in r.getMessage())
    assert quantized == changed > 0
    # the quantization's own error is there (the test would pass on float32 weights otherwise)
    assert (eager - out).abs().max() > 1e-4


def test_int8_compute_stays_near_the_dequantized_reference():
    """accuracy_level=4 (the default: activations quantized to int8 per block, where the
    CPU has the instructions): near the dequantized reference, not exact."""
    model, args = MODELS["llama"]()
    model.eval()
    ref, _ = _reference(model, "int4", 32, False)
    torch._dynamo.reset()
    with torch.no_grad():
        out = output_tensor(torch.compile(copy.deepcopy(model), backend="lort",
                                          options={"quantize": "int4", "executor": "ort", "disk_cache": False})(*args))
        expected = output_tensor(ref(*args))
    rel = ((out - expected).norm() / expected.norm()).item()
    assert rel < 0.02, rel


# int8_dynamic: uint8 weights per output column, activations quantized per call.


def _dynamic_weight(w_kn: np.ndarray, symmetric: bool) -> torch.Tensor:
    """``w_kn`` quantized per column by onnxruntime's own quantize_data (its per-channel
    quantizer's loop), dequantized: [K, N] float64."""
    from onnx import TensorProto
    from onnxruntime.quantization.quant_utils import quantize_data

    cols = []
    for j in range(w_kn.shape[1]):
        zero_point, scale, q = quantize_data(np.ascontiguousarray(w_kn[:, j]), TensorProto.UINT8, symmetric)
        cols.append((q.astype(np.float64) - float(zero_point)) * float(scale))
    return torch.from_numpy(np.stack(cols, axis=1))


def _dynamic_activation(x: torch.Tensor) -> torch.Tensor:
    """ONNX's DynamicQuantizeLinear of ``x`` (one uint8 scale and zero point for the
    tensor, float32 arithmetic), dequantized: float64."""
    lo = np.float32(min(x.min().item(), 0.0))
    hi = np.float32(max(x.max().item(), 0.0))
    scale = np.float32((hi - lo) / np.float32(255))
    if scale == 0:
        return x.double()
    zero_point = float(np.clip(np.round(-lo / scale), 0, 255))
    q = torch.clamp(torch.round(x.float() / torch.tensor(scale)) + zero_point, 0, 255)
    return (q.double() - zero_point) * float(scale)


class _DynamicProduct(torch.nn.Module):
    """What DynamicQuantizeMatMul computes for a layer: quantized activation times the
    dequantized weight, exact in float64 (the integer products are exact)."""

    def __init__(self, w_kn: np.ndarray, bias: torch.Tensor | None, symmetric: bool):
        super().__init__()
        self.w = _dynamic_weight(w_kn, symmetric)
        self.b = None if bias is None else bias.detach().double()

    def forward(self, x):
        y = _dynamic_activation(x) @ self.w
        return (y if self.b is None else y + self.b).float()


def _dynamic_reference(model: torch.nn.Module, symmetric: bool = False) -> tuple[torch.nn.Module, int]:
    """``model`` with each linear layer (and transformers' Conv1D) replaced by its
    _DynamicProduct, and how many it replaced."""
    from transformers.pytorch_utils import Conv1D

    def product(layer):
        if isinstance(layer, torch.nn.Linear):
            return _DynamicProduct(layer.weight.detach().numpy().T, layer.bias, symmetric)
        if isinstance(layer, Conv1D):  # weight [K, N]
            return _DynamicProduct(layer.weight.detach().numpy(), layer.bias, symmetric)
        return None

    if product(model) is not None:
        return product(model), 1
    ref = copy.deepcopy(model)
    changed = 0
    for module in list(ref.modules()):
        for name, child in list(module.named_children()):
            replacement = product(child)
            if replacement is not None:
                setattr(module, name, replacement)
                changed += 1
    return ref, changed


def test_per_column_quantization_is_onnxruntimes_quantize_data():
    """lort's one-pass per-column quantization gives quantize_data's numbers column by
    column, an all-zero and a constant column included."""
    from onnx import TensorProto
    from onnxruntime.quantization.quant_utils import quantize_data

    from lort.compile.quantize import _per_column_uint8

    w = np.random.default_rng(0).standard_normal((96, 40)).astype(np.float32)
    w[:, 3], w[:, 4], w[:, 5] = 0, 0.7, -2
    for symmetric in (False, True):
        q, scales, zero_points = _per_column_uint8(w, symmetric)
        for j in range(w.shape[1]):
            zero_point, scale, column = quantize_data(np.ascontiguousarray(w[:, j]), TensorProto.UINT8, symmetric)
            assert (zero_point, scale) == (zero_points[j], scales[j]), (symmetric, j)
            np.testing.assert_array_equal(column, q[:, j])


class _ByParameter(torch.nn.Module):
    """A product by a parameter with no Linear around it (a MatMul by an initializer)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 48) * 0.1)

    def forward(self, x):
        return torch.relu(x @ self.w)


def _one_product(form: str):
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    x = torch.randn(3, 7, 64)
    if form == "linear":
        return torch.nn.Linear(64, 48), x
    if form == "linear_2d_no_bias":
        return torch.nn.Linear(64, 48, bias=False), x[0]
    if form == "conv1d":  # GPT-2's Gemm(x, W)
        return Conv1D(48, 64), x
    return _ByParameter(), x


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("form", ["linear", "linear_2d_no_bias", "conv1d", "by_parameter"])
def test_int8_dynamic_product_matches_its_integer_reference(form, symmetric, caplog):
    """One product in each form lort's graphs hold: DynamicQuantizeMatMul over lort's
    uint8 weights equals the quantized activation times the dequantized weight within
    float32's tolerances, an activation with large positive outliers included (u8s8
    products saturate on CPUs without VNNI; uint8 weights do not)."""
    import logging

    model, x = _one_product(form)
    model.eval()
    x = x.clone()
    x[..., :4] = x[..., :4].abs() * 20  # activations near 255 after quantization
    if form == "by_parameter":
        ref, changed = copy.deepcopy(model), 1
        ref.w = None
        w = _dynamic_weight(model.w.detach().numpy(), symmetric)
        expected = torch.relu((_dynamic_activation(x) @ w).float())
    else:
        ref, changed = _dynamic_reference(model, symmetric)
        expected = ref(x)
    torch._dynamo.reset()
    options = {"quantize": "int8_dynamic", "quantize_symmetric": symmetric, "executor": "ort", "disk_cache": False}
    with caplog.at_level(logging.INFO, logger="lort"), torch.no_grad():
        out = torch.compile(copy.deepcopy(model), backend="lort", options=options)(x)
        eager = model(x)
    torch.testing.assert_close(out, expected)
    assert any("quantized 1 product(s) to int8_dynamic" in r.getMessage() for r in caplog.records)
    assert (eager - out).abs().max() > 1e-3  # the quantization's own error is there


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_int8_dynamic_model_stays_at_its_reference(name, caplog):
    """A whole model: every weight matrix quantized, and lort's output near the
    reference that quantizes the same way, far nearer than to eager float32. Not
    exact: a value that rounds to the other side of an activation's quantization step
    (float32 differences of an ulp upstream) moves its layer's output by a step."""
    import logging

    from lort.testing.models import bert

    model, args = bert(batch=2, seq=16, layers=2, hidden=64, heads=4) if name == "bert" else MODELS[name]()
    model.eval()
    ref, changed = _dynamic_reference(model)
    torch._dynamo.reset()
    options = {"quantize": "int8_dynamic", "executor": "ort", "disk_cache": False}
    with caplog.at_level(logging.INFO, logger="lort"), torch.no_grad():
        out = output_tensor(torch.compile(copy.deepcopy(model), backend="lort", options=options)(*args))
        expected = output_tensor(ref(*args))
        eager = output_tensor(model(*args))
    quantized = sum(int(r.getMessage().split("quantized ")[1].split(" ")[0]) for r in caplog.records
                    if "product(s) to int8_dynamic" in r.getMessage())
    assert quantized == changed > 0

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(eager, expected) > 1e-4  # the quantization's own error
    assert rel(out, expected) < 0.1 * rel(eager, expected), (rel(out, expected), rel(eager, expected))


@pytest.mark.parametrize("scheme", ["int8", "int8_dynamic"])
def test_quantized_model_through_ortmodule_matches_the_reference(scheme):
    model, args = MODELS["mlp"]()
    model.eval()
    ref = _reference(model, "int8", 32, False)[0] if scheme == "int8" else _dynamic_reference(model)[0]
    wrapped = lort.ORTModule(copy.deepcopy(model), options={
        "quantize": scheme, "quantize_accuracy_level": 1, "executor": "ort", "disk_cache": False})
    with torch.no_grad():
        torch.testing.assert_close(wrapped(*args), ref(*args))


@pytest.mark.parametrize("front_end", ["torch.compile", "ORTModule"])
def test_training_through_a_quantized_model_is_a_clear_error(front_end):
    """torch.compile wraps a backend's error in Dynamo's BackendCompilerFailed, whose
    message carries lort's."""
    model, args = MODELS["mlp"]()
    torch._dynamo.reset()
    options = {"quantize": "int4", "executor": "ort", "disk_cache": False}
    wrapped = (torch.compile(model, backend="lort", options=options) if front_end == "torch.compile"
               else lort.ORTModule(model, options=options))
    with pytest.raises(Exception, match=r"quantize='int4' is for inference only.*torch.no_grad") as caught:
        wrapped(*args)
    error = getattr(caught.value, "inner_exception", caught.value)
    assert isinstance(error, QuantizationError) and isinstance(error, UnsupportedInputError), type(caught.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_that_is_not_float32_is_a_clear_error(dtype):
    model, (x,) = MODELS["mlp"]()
    model = model.eval().to(dtype)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="lort",
                             options={"quantize": "int8_dynamic", "executor": "ort", "disk_cache": False})
    with pytest.raises(Exception, match=rf"quantizes float32 models, and this graph has {str(dtype)[6:]}") as caught, \
            torch.no_grad():
        compiled(x.to(dtype))
    assert isinstance(getattr(caught.value, "inner_exception", caught.value), QuantizationError)


@pytest.mark.parametrize("options, message", [
    ({"quantize": "int3"}, r"quantize='int3' is not one of \(None, 'int4', 'int8', 'int8_dynamic'\)"),
    ({"quantize": "int4", "quantize_block_size": 48, "executor": "ort"}, r"quantize_block_size=48 is not one of"),
    ({"quantize": "int4", "quantize_accuracy_level": 7, "executor": "ort"}, r"must be an int 0-4"),
    ({"quantize": "int4", "quantize_accuracy_level": 4.0, "executor": "ort"}, r"must be an int 0-4"),
    ({"quantize": "int4", "quantize_block_size": 32.0, "executor": "ort"}, r"quantize_block_size=32.0 is not one of"),
    ({"quantize": "int4", "executor": "auto"}, r"needs executor='ort'"),
    ({"quantize": "int4", "executor": "ort", "freeze": False}, r"needs frozen weights"),
    ({"quantize": "int8", "executor": "ort", "mode": "debug"}, r"needs mode='ort'"),
])
def test_quantize_options_name_what_is_allowed(options, message):
    with pytest.raises(ValueError, match=message):
        lort.Options(**options)


def test_a_weight_is_quantized_once_for_every_graph_and_again_after_it_changes(monkeypatch):
    """Two graphs of one model (two input shapes, dynamic=False) share each weight's
    quantized arrays; an in-place change of a weight (a new version) quantizes it again,
    and the output follows the new values."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer

    calls = []
    real = DefaultWeightOnlyQuantizer.qbits_block_quant
    monkeypatch.setattr(DefaultWeightOnlyQuantizer, "qbits_block_quant",
                        lambda self, w: calls.append(w.shape) or real(self, w))
    model, (x,) = MODELS["mlp"]()
    model.eval()
    torch._dynamo.reset()
    options = {"quantize": "int8", "quantize_accuracy_level": 1, "executor": "ort", "disk_cache": False}
    cm = torch.compile(model, backend="lort", options=options, dynamic=False)
    from torch._dynamo.utils import counters

    counters.clear()
    with torch.no_grad():
        for rows in (3, 2):
            cm(x[:rows])
    assert counters["stats"]["unique_graphs"] == 2
    assert len(calls) == 2, calls  # two weight matrices, quantized once for both graphs
    with torch.no_grad():
        model[0].weight.mul_(2)
        out = cm(x[:3])
        assert len(calls) == 3, calls  # the changed weight only
        ref, _ = _reference(model, "int8", 32, False)  # (quantizes through the same function)
        torch.testing.assert_close(out, ref(x[:3]))


def test_dynamic_shapes_quantize_and_match_the_reference():
    """Under ``dynamic=True`` Dynamo passes a module's float attributes (Llama's norm
    epsilons, its attention scaling) as 0-d float64 tensors: they are scalars, neither
    weights to freeze nor a reason to refuse the float32 model."""
    model, args = MODELS["llama"]()
    model.eval()
    ref, changed = _reference(model, "int4", 32, False)
    options = {"quantize": "int4", "quantize_accuracy_level": 1, "executor": "ort", "disk_cache": False}
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), backend="lort", options=options, dynamic=True)
    with torch.no_grad():
        for seq in (16, 9):
            ids = args[0][:, :seq]
            torch.testing.assert_close(output_tensor(compiled(ids)), output_tensor(ref(ids)))


class _CountingLinear(torch.nn.Module):
    """A linear layer whose forward also updates a buffer the graph reads: it changes on
    every call, so its group cannot stay frozen."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 32)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.fc(x) + self.calls


def test_a_group_that_cannot_stay_frozen_warns_that_its_quantization_is_gone(caplog):
    """Quantized weights are frozen ones: a group left with its weights as inputs runs the
    float32 weights, which changes its results, so lort warns (logging, lort logger)."""
    import logging

    torch.manual_seed(0)
    model = _CountingLinear().eval()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="lort", options={"quantize": "int4", "executor": "ort", "disk_cache": False})
    x = torch.randn(4, 64)
    with caplog.at_level(logging.INFO, logger="lort"), torch.no_grad():
        for _ in range(4):
            out = compiled(x)
            want = ref(x)
    torch.testing.assert_close(model.calls, ref.calls)
    torch.testing.assert_close(out, want)  # the last call: float32 weights, eager's result
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "quantize='int4'" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
