"""translate/token_layout.py: products on the token layout, attention with its cache
appended inside. The rewritten graphs give the values of the graphs before them, bit for
bit, on ORT's CPU kernels; the patterns it must leave alone stay as they were."""

import collections

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import lort
from lort.translate import token_layout


def _tiny_llama(layers: int):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def _generate(model, ids, monkeypatch, rewrite: bool, mask=None, **options):
    """Greedy tokens, each step's logits and how many attentions were rewritten, through
    lort, with or without the rewrites."""
    if not rewrite:
        monkeypatch.setattr(token_layout, "tidy", lambda model: {})
    backend = lort.LortBackend(lort.Options(executor="ort", disk_cache=False, **options))
    forward = model.forward
    model.forward = torch.compile(forward, backend=backend)
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                 pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    finally:
        model.forward = forward
        monkeypatch.undo()
    if mask is None:  # (a mask's step also has symbolic-size arithmetic, left to PyTorch)
        assert all(r.torch_nodes == 0 for r in backend.records), [r.fallbacks for r in backend.records]
    fired = collections.Counter()
    for record in backend.records:
        for group in record.groups:
            fired.update(group.fusions)
    return out.sequences, torch.stack(out.logits), fired


def _eager_tokens(model, ids, mask=None):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                              pad_token_id=0)


@pytest.mark.parametrize("layers,quantize", [(2, None), (2, "int4"), (6, None)])
def test_decoding_is_bit_identical_with_and_without_the_rewrites(layers, quantize, monkeypatch):
    """A Llama-style decoder (grouped key/value heads, a cache); 6 layers go through the
    layer-by-layer translation (translate/repeated.py). int4: the products are
    MatMulNBits."""
    model = _tiny_llama(layers)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    options = {"quantize": quantize} if quantize else {}
    tokens, logits, fired = _generate(model, ids, monkeypatch, True, **options)
    # every layer of each graph reading the cache (a decode step: Dynamo's static one,
    # then its dynamic one)
    assert fired["attention_on_tokens"] >= layers and fired["attention_on_tokens"] % layers == 0, fired
    assert fired["flatten_products"] >= 5 * layers, fired
    plain_tokens, plain_logits, _ = _generate(model, ids, monkeypatch, False, **options)
    assert torch.equal(tokens, plain_tokens)
    assert torch.equal(logits, plain_logits)
    if quantize is None:
        assert torch.equal(tokens, _eager_tokens(model, ids))


def test_a_padded_batch_decodes_as_without_the_rewrites(monkeypatch):
    """Two prompts, the shorter padded on the left: every step's attention takes a mask
    over the cache and the new token, which the rewritten Attention applies to the keys
    it appends itself; transformers repeats the key/value heads for the mask's path
    (repeat_kv), which the rewrite leaves to Attention."""
    model = _tiny_llama(2)
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    ids[1, :2] = 0
    mask = (ids != 0).long()
    tokens, logits, fired = _generate(model, ids, monkeypatch, True, mask=mask)
    assert fired["attention_on_tokens"] >= 2, fired
    plain_tokens, plain_logits, _ = _generate(model, ids, monkeypatch, False, mask=mask)
    assert torch.equal(tokens, plain_tokens) and torch.equal(logits, plain_logits)
    assert torch.equal(tokens, _eager_tokens(model, ids, mask))


# --- the rewrites on small ONNX graphs -------------------------------------------------------


def _run(model: onnx.ModelProto, feeds: dict) -> list:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _tidied(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    m = ir.serde.deserialize_model(model)
    counts = token_layout.tidy(m)
    return ir.serde.serialize_model(m), counts


def _const(name, values):
    return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)


def _product_graph(op: str, domain: str = "", extra_reader: bool = False, **attributes) -> onnx.ModelProto:
    """x [2, 3, 8] -> Reshape [6, 8] -> op(., w [8, 5]) -> Reshape [2, 3, 5] -> Relu."""
    nodes = [helper.make_node("Reshape", ["x", "flat_shape"], ["flat"]),
             helper.make_node(op, ["flat", "w"], ["y"], domain=domain, **attributes),
             helper.make_node("Reshape", ["y", "out_shape"], ["y3"]),
             helper.make_node("Relu", ["y3"], ["out"])]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3, 5])]
    if extra_reader:  # the flattened input is also an output (as a saved activation)
        outputs.append(helper.make_tensor_value_info("flat", TensorProto.FLOAT, [6, 8]))
    w = np.random.default_rng(0).standard_normal((8, 5)).astype(np.float32)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])], outputs,
                              initializer=[_const("flat_shape", [6, 8]), _const("out_shape", [2, 3, 5]),
                                           onnx.numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize("extra_reader", [False, True])
def test_a_product_reads_the_token_layout(extra_reader):
    model = _product_graph("MatMul", extra_reader=extra_reader)
    x = np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)
    tidied, counts = _tidied(model)
    assert counts == {"flatten_products": 1}
    ops = collections.Counter(n.op_type for n in tidied.graph.node)
    assert ops["Reshape"] == (1 if extra_reader else 0) and ops["MatMul"] == 1, ops
    for got, want in zip(_run(tidied, {"x": x}), _run(model, {"x": x})):
        np.testing.assert_array_equal(got, want)


def test_a_reshape_that_copies_a_size_keeps_the_product_flat():
    """A 0 in a Reshape's target copies the input's size at that place: on a
    three-dimensional product it would copy another size."""
    model = _product_graph("MatMul")
    # [6, 5] -> [0, -1] is [6, 5]; [2, 3, 5] -> [0, -1] would be [2, 15]
    model.graph.initializer[1].CopyFrom(_const("out_shape", [0, -1]))
    model.graph.node[3].op_type = "Identity"  # (no Relu shape to keep)
    del model.graph.value_info[:]
    model.graph.output[0].type.tensor_type.ClearField("shape")
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    x = np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)
    tidied, counts = _tidied(model)
    assert counts == {}
    assert _run(tidied, {"x": x})[0].shape == (6, 5)


def test_a_fused_product_that_transposes_its_input_is_left_alone():
    """FusedMatMul's transA transposes the last two axes: of [6, 8] the whole matrix, of
    [2, 3, 8] each row block; not the same product."""
    model = _product_graph("FusedMatMul", domain="com.microsoft", transA=1)
    # (8, 6) x ... needs w of [6, 5]: the pattern's shapes only have to be static here
    model.graph.initializer[2].CopyFrom(onnx.numpy_helper.from_array(np.ones((6, 5), np.float32), "w"))
    _, counts = _tidied(model)
    assert counts == {}


def test_attention_without_the_pattern_is_left_alone():
    """A 4-d Attention whose key is no cache append (no Concat) keeps its form."""
    q = helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, 2, 3, 4])
    nodes = [helper.make_node("Attention", ["q", "q", "q"], ["y"])]
    graph = helper.make_graph(nodes, "g", [q], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    tidied, counts = _tidied(model)
    assert counts == {} and [n.op_type for n in tidied.graph.node] == ["Attention"]
