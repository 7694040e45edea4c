"""PyTorch's CPU attention kernel as ONNX's Attention in inference graphs
(translate/attention.py): results against eager on the same inputs, the node ORT runs,
and the graphs that keep the math form or leave the kernel to PyTorch."""

import collections
import glob
import math

import onnx
import pytest
import torch
import torch.nn.functional as F

import lort

INF = math.inf


def _compiled(fn, tmp_path, **options):
    backend = lort.LortBackend(lort.Options(executor="ort", disk_cache=False, save_onnx=str(tmp_path), **options))
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False), backend


def _attention_nodes(tmp_path) -> list[tuple[str, int, int]]:
    """(op type, default-domain opset, number of outputs) of each Attention node in the
    saved groups."""
    found = []
    for path in sorted(glob.glob(str(tmp_path / "*.onnx"))):
        model = onnx.load(path, load_external_data=False)
        opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        found += [(n.op_type, opset, len(n.output)) for n in model.graph.node if n.op_type == "Attention"]
    return found


def _qkv(s=3, t=5, heads=4, kv_heads=4, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, heads, s, d, generator=g), torch.randn(2, kv_heads, t, d, generator=g),
            torch.randn(2, kv_heads, t, d, generator=g))


def _masks():
    g = torch.Generator().manual_seed(1)
    boolean = torch.rand(2, 1, 3, 5, generator=g) > 0.3
    boolean[0, 0, 1] = False  # a row that sees no key
    additive = torch.randn(2, 4, 3, 5, generator=g)
    additive[1, 2, 2] = -INF  # a row of -inf only
    additive[0, 0, 0, 1] = -INF
    return boolean, additive


BOOL_MASK, FLOAT_MASK = _masks()
CASES = {
    "plain": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), {}),
    "causal-square": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), dict(s=5)),
    "causal-fewer-queries": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), {}),
    "grouped-heads": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), dict(kv_heads=2)),
    "bool-mask": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=BOOL_MASK), {}),
    "float-mask": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=FLOAT_MASK), {}),
    "scale": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3), {}),
    "one-query-row": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), dict(s=1, t=9, heads=6, kv_heads=6)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_inference_attention_is_one_ort_node_and_equals_eager(case, tmp_path):
    fn, shape = CASES[case]
    args = _qkv(**shape)
    run, backend = _compiled(lambda q, k, v: fn(q, k, v) * 2, tmp_path)
    with torch.no_grad():
        got = run(*args)
        want = fn(*args) * 2
    torch.testing.assert_close(got, want)
    if case in ("bool-mask", "float-mask"):  # the rows that see no key: zeros, as eager's
        row = (0, 0, 1) if case == "bool-mask" else (1, 2, 2)
        assert (got[row] == 0).all() and (want[row] == 0).all()
    record = backend.records[-1]
    assert record.kind == "inference" and record.torch_nodes == 0, record.fallbacks
    assert _attention_nodes(tmp_path) == [("Attention", 23, 1)]


def _op_counts(tmp_path) -> list[collections.Counter]:
    """Per saved group, how many nodes of each op type it holds."""
    return [collections.Counter(n.op_type for n in onnx.load(path, load_external_data=False).graph.node)
            for path in sorted(glob.glob(str(tmp_path / "*.onnx")))]


@pytest.mark.parametrize("layers", [2, 6])
def test_a_decoder_generates_eager_tokens(layers, tmp_path):
    """A Llama-style decoder (grouped key/value heads, rotary embedding, a key/value
    cache): greedy tokens and logits as eager's, attention in ORT, and the rotary
    embedding of each layer's query and key as ONNX's RotaryEmbedding (onnxscript's
    fusion, translate/_compat._onnx_fusions; 6 layers are translated one layer at a
    time and stitched: translate/repeated.py). The steps that read a cache append to it
    inside Attention, on the token layout (translate/token_layout.py): the node gives
    the present key and value, and no Concat or Transpose is left."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        want_logits = model(want).logits
    plain = model.forward
    backend = lort.LortBackend(lort.Options(executor="ort", disk_cache=False, save_onnx=str(tmp_path)))
    model.forward = torch.compile(plain, backend=backend)
    got = model.generate(ids, **kw)
    with torch.no_grad():
        got_logits = model(want).logits
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits)
    assert all(r.torch_nodes == 0 for r in backend.records), [r.fallbacks for r in backend.records]
    nodes = _attention_nodes(tmp_path)
    assert nodes and set(nodes) <= {("Attention", 23, 1), ("Attention", 23, 3)}, nodes
    assert ("Attention", 23, 3) in nodes, "no step appended to the cache inside Attention"
    counts = _op_counts(tmp_path)
    assert counts and all(c["RotaryEmbedding"] == 2 * layers and c["Neg"] == 0 for c in counts), counts
    for path in glob.glob(str(tmp_path / "*.onnx")):
        graph = onnx.load(path, load_external_data=False).graph
        if any(n.op_type == "Attention" and len(n.output) == 3 for n in graph.node):
            assert {n.op_type for n in graph.node}.isdisjoint({"Concat", "Transpose"}), path
            assert all(len(n.output) == 3 for n in graph.node if n.op_type == "Attention"), path


def test_training_graphs_keep_the_math_form(tmp_path):
    """A graph with gradients traces attention's math form, whose backward ORT runs:
    gradients as eager's, no Attention node."""
    q, k, v = (t.requires_grad_() for t in _qkv())
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    run, _ = _compiled(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), tmp_path)
    run(q, k, v).square().sum().backward()
    F.scaled_dot_product_attention(*ref, is_causal=True).square().sum().backward()
    for a, b in zip((q, k, v), ref):
        torch.testing.assert_close(a.grad, b.grad)
    assert _attention_nodes(tmp_path) == []


def test_the_log_sum_exp_read_keeps_the_kernel_in_pytorch(tmp_path):
    """ONNX's Attention does not compute the kernel's log-sum-exp: a graph that reads it
    leaves the kernel to PyTorch, with eager's values."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    run, backend = _compiled(lambda q, k, v: [t * 2 for t in kernel(q, k, v)], tmp_path)
    args = _qkv()
    with torch.no_grad():
        got = run(*args)
        want = [t * 2 for t in kernel(*args)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    reasons = [str(why) for op, why in backend.records[-1].fallbacks if "flash_attention" in op]
    assert reasons and "log-sum-exp" in reasons[0]


def test_dropout_keeps_the_kernel_in_pytorch(tmp_path):
    """Attention with dropout draws random numbers: PyTorch draws them (its math form's
    dropout stays in PyTorch), so they follow PyTorch's generator (the same seed, the
    same result as eager); no Attention node."""
    run, backend = _compiled(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5) * 2, tmp_path)
    args = _qkv()
    with torch.no_grad():
        torch.manual_seed(3)
        got = run(*args)
        torch.manual_seed(3)
        want = F.scaled_dot_product_attention(*args, dropout_p=0.5) * 2
    torch.testing.assert_close(got, want)
    assert _attention_nodes(tmp_path) == []
    assert [why.kind.name for _, why in backend.records[-1].fallbacks] == ["RANDOM"]


def test_float64_inference_keeps_the_math_form(tmp_path):
    """Only float32 graphs get ONNX's Attention; a float64 one traces the math form."""
    args = [t.double() for t in _qkv()]
    run, backend = _compiled(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), tmp_path)
    with torch.no_grad():
        got = run(*args)
        want = F.scaled_dot_product_attention(*args, is_causal=True)
    torch.testing.assert_close(got, want)
    assert _attention_nodes(tmp_path) == []
    assert backend.records[-1].torch_nodes == 0


def test_rotary_angles_of_one_row_are_expanded_over_the_batch(tmp_path):
    """A forward without position ids makes the rotary angles for one row, which the
    unfused ops broadcast over the batch; ORT's RotaryEmbedding takes them per row, so
    lort expands them (translate/_compat._rotary_angles_per_row). Eager's logits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (3, 7), generator=torch.Generator().manual_seed(1))
    run, backend = _compiled(model, tmp_path)
    with torch.no_grad():
        got, want = run(ids).logits, model(ids).logits
    torch.testing.assert_close(got, want)
    assert backend.records[-1].torch_nodes == 0
    (counts,) = _op_counts(tmp_path)
    assert counts["RotaryEmbedding"] == 4 and counts["Neg"] == 0 and counts["Expand"] >= 1, counts
