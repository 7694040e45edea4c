"""Options.quantize: the products of one activation joined into one node
(compile/quantize.py, JOIN_PRODUCTS): a layer's q, k and v, a feed-forward's gate and up.

Each test compares the joined model against the same model with the products apart, and
against eager PyTorch on the dequantized weights (test_quantize.py's references)."""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch

from lort.compile import quantize
from lort.testing.models import llama, output_tensor
from test_quantize import _dynamic_reference, _reference


def _nodes_logged(caplog) -> list[tuple[int, int]]:
    """(products, nodes) of every "quantized N product(s) ... in M node(s)" line."""
    found = []
    for r in caplog.records:
        m = re.search(r"quantized (\d+) product\(s\) to \S+ in (\d+) node\(s\)", r.getMessage())
        if m:
            found.append((int(m.group(1)), int(m.group(2))))
    return found


def _compiled(model, options, join: bool, monkeypatch, caplog, *args):
    monkeypatch.setattr(quantize, "JOIN_PRODUCTS", join)
    torch._dynamo.reset()
    caplog.clear()
    cm = torch.compile(copy.deepcopy(model), backend="lort", options=options)
    with caplog.at_level(logging.INFO, logger="lort"), torch.no_grad():
        return output_tensor(cm(*args)), _nodes_logged(caplog)


class _ThreeHeads(torch.nn.Module):
    """Three linear layers with biases reading one activation (Qwen2's q, k and v), and a
    fourth reading another: the three join (their biases added after the Split), the
    fourth stays. (A layer without a bias among them reads the 3-D activation where the
    others read its 2-D view, and stays apart.)"""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(64)
        self.q, self.k, self.v = torch.nn.Linear(64, 48), torch.nn.Linear(64, 16), torch.nn.Linear(64, 16)
        self.out = torch.nn.Linear(80, 64)

    def forward(self, x):
        h = self.norm(x)
        return self.out(torch.cat([torch.relu(self.q(h)), self.k(h) * 2, self.v(h)], dim=-1))


@pytest.mark.parametrize("scheme", ["int4", "int8", "int8_dynamic"])
def test_joined_products_equal_the_products_apart_and_the_reference(scheme, monkeypatch, caplog):
    """q, k and v with biases become one node: the output equals the model
    with the products apart bit for bit (each output column is computed alike), and eager
    on the dequantized weights within float32's tolerances."""
    model = _ThreeHeads().eval()
    x = torch.randn(2, 5, 64)
    options = {"quantize": scheme, "quantize_accuracy_level": 1, "executor": "ort", "disk_cache": False}
    apart, apart_nodes = _compiled(model, options, False, monkeypatch, caplog, x)
    joined, joined_nodes = _compiled(model, options, True, monkeypatch, caplog, x)
    assert apart_nodes == [(4, 4)] and joined_nodes == [(4, 2)], (apart_nodes, joined_nodes)
    assert torch.equal(joined, apart)
    if scheme == "int8_dynamic":
        ref, changed = _dynamic_reference(model)
    else:
        ref, changed = _reference(model, scheme, 32, False)
    assert changed == 4
    with torch.no_grad():
        torch.testing.assert_close(joined, ref(x))


def test_a_decoder_joins_q_k_v_and_gate_up_at_int8_compute(monkeypatch, caplog):
    """A Llama-style decoder at the default accuracy level (int8 compute): seven products
    a layer in four nodes, the logits bit for bit those of the products apart."""
    model, args = llama(batch=2, seq=16, layers=2, hidden=64, heads=4, kv_heads=2)
    model.eval()
    options = {"quantize": "int4", "executor": "ort", "disk_cache": False}
    apart, apart_nodes = _compiled(model, options, False, monkeypatch, caplog, *args)
    joined, joined_nodes = _compiled(model, options, True, monkeypatch, caplog, *args)
    assert apart_nodes == [(14, 14)] and joined_nodes == [(14, 8)], (apart_nodes, joined_nodes)
    assert torch.equal(joined, apart)


def test_joined_weights_are_quantized_once_for_every_graph(monkeypatch, caplog):
    """Two graphs of one decoder (two prompt lengths, dynamic=False) share each joined
    run's arrays: the quantizer runs once per node of one graph, not per graph; after one
    weight of a run changes in place, that run alone is quantized again, and the output
    follows the new values."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer

    calls = []
    real = DefaultWeightOnlyQuantizer.qbits_block_quant
    monkeypatch.setattr(DefaultWeightOnlyQuantizer, "qbits_block_quant",
                        lambda self, w: calls.append(w.shape) or real(self, w))
    model, (ids,) = llama(batch=1, seq=12, layers=2, hidden=64, heads=4, kv_heads=2)
    model.eval()
    monkeypatch.setattr(quantize, "JOIN_PRODUCTS", True)
    torch._dynamo.reset()
    options = {"quantize": "int8", "quantize_accuracy_level": 1, "executor": "ort", "disk_cache": False}
    cm = torch.compile(model, backend="lort", options=options, dynamic=False)
    with torch.no_grad():
        for seq in (12, 7):
            cm(ids[:, :seq])
    assert len(calls) == 8, calls  # 2 layers x (q/k/v, o, gate/up, down), for both graphs
    layer = model.layers[0].self_attn
    assert calls.count((64, 64 + 2 * 32)) == 2  # q (64) and k, v (32 each: 2 heads of 16) side by side
    with torch.no_grad():
        layer.k_proj.weight.mul_(2)
        out = output_tensor(cm(ids[:, :7]))
        assert len(calls) == 9 and calls[-1] == (64, 128), calls
        ref, _ = _reference(model, "int8", 32, False)
        torch.testing.assert_close(out, output_tensor(ref(ids[:, :7])))


def test_a_product_whose_bias_a_node_computes_stays_apart():
    """The joined node takes the first member's place, so a member whose Gemm bias is
    computed by a node (which may come after that place) is not joined; its neighbour with
    an initializer bias still is quantized, and the graph keeps its order."""
    import numpy as np
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    from lort.options import Options

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float32), name)
             for name in ("w1", "w2")]
    inits += [numpy_helper.from_array(np.ones(32, np.float32), name) for name in ("b1", "b0")]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["y1"], transB=1),
             helper.make_node("Add", ["b0", "b0"], ["b2"]),  # a bias computed after the first product
             helper.make_node("Gemm", ["x", "w2", "b2"], ["y2"], transB=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, [4, 32]) for y in ("y1", "y2")],
                              inits)
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    result = quantize.quantize_products(model, Options(quantize="int8", executor="ort"))
    assert (result.products, result.joined) == (2, 0)
    order = [n.op_type for n in model.graph]
    assert order.count("MatMulNBits") == 2 and "Split" not in order
    seen = {v.name for v in model.graph.inputs} | set(model.graph.initializers)
    for node in model.graph:  # every input defined before its node
        assert all(v is None or v.name in seen for v in node.inputs), node
        seen |= {v.name for v in node.outputs}
