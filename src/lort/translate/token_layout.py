"""Two rewrites of a translated inference graph that drop nodes which only move data
between layouts, where a decoder's step spends its time outside the products:

- **products on the token layout** (``flatten_products``): Hugging Face's linear layers
  reach ONNX as ``Reshape([b, s, k] -> [b*s, k]) -> MatMul -> Reshape([b*s, n] ->
  [b, s, n])`` (``aten.view``, ``aten.mm``, ``aten._unsafe_view``). ``MatMul``,
  ``FusedMatMul`` and ``MatMulNBits`` take the three-dimensional input as it is and give
  the same rows, so both reshapes go.
- **attention on the token layout, its cache inside** (``attention_on_tokens``): each
  layer's query, key and value go ``Reshape([b, s, heads, d]) -> Transpose(0, 2, 1, 3)
  -> RotaryEmbedding`` into ``Attention``; the key and value are first appended to the
  cache by ``Concat(past, new, axis=2)``, and the output goes back by ``Transpose ->
  Reshape([b, s, heads*d])``. ONNX's ``Attention`` takes the query, key and value as
  ``[b, s, heads*d]`` (its ``q_num_heads``, ``kv_num_heads``), appends the new key and
  value to ``past_key`` / ``past_value`` itself and gives the caches as
  ``present_key`` / ``present_value``; ``RotaryEmbedding`` takes ``[b, s, heads*d]`` with
  ``num_heads``. The rewrite uses those forms: per layer four Transposes, two Concats and
  four to six Reshapes fewer.

Both give the same values as the graph before them, bit for bit on ORT's CPU kernels
(tests/test_token_layout.py). They act only where every shape involved is static and
every intermediate value has no other reader; anything else is left as it was. On a
decode step of an 8-layer int4 decoder 1536 wide, ORT runs 136 kernels where it ran 264,
about 1 ms less of them, but Attention takes 0.3 ms more; the step's time moved by
0-6% between runs, within their spread, and not measurably at 28 layers
(benchmarks/results/quantized_decoding.md, "Layout nodes out of the decode step")."""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from .external_data import initializer

_PRODUCTS = {("", "MatMul"), ("ai.onnx", "MatMul"), ("com.microsoft", "FusedMatMul"),
             ("com.microsoft", "MatMulNBits")}
_HEADS_FIRST = (0, 2, 1, 3)


def tidy(model: ir.Model) -> dict[str, int]:
    """Both rewrites, attention's first (it leaves the output projection's input on the
    token layout for the products' rewrite), in place; the count of each."""
    counts = {"attention_on_tokens": attention_on_tokens(model.graph),
              "flatten_products": flatten_products(model.graph)}
    if any(counts.values()):
        RemoveUnusedNodesPass()(model)
    return {k: v for k, v in counts.items() if v}


def _static(value: ir.Value | None) -> tuple[int, ...] | None:
    if value is None or value.shape is None or not all(isinstance(d, int) for d in value.shape.dims):
        return None
    return tuple(value.shape.dims)


def _ints(value: ir.Value | None) -> tuple[int, ...] | None:
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    if tensor is None:
        return None
    return tuple(int(x) for x in np.asarray(tensor.numpy()).reshape(-1))


def _is(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _swaps_heads(node: ir.Node | None) -> bool:
    """``node`` is Transpose(0, 2, 1, 3): [b, s, heads, d] <-> [b, heads, s, d]."""
    return _is(node, "Transpose") and tuple(node.attributes.get_ints("perm", ())) == _HEADS_FIRST


def _sole_reader(value: ir.Value) -> ir.Node | None:
    """The one node reading ``value`` (once), or None."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    return uses[0].node


def _reshape_to(value: ir.Value, shape: tuple[int, ...], graph: ir.Graph, before: ir.Node) -> ir.Value:
    """``value`` reshaped to ``shape`` (``value`` itself where its shape is already that)."""
    if _static(value) == shape:
        return value
    target = initializer(graph, f"{value.name}_as_{'x'.join(map(str, shape))}", np.array(shape, dtype=np.int64))
    node = ir.node("Reshape", [value, target], {"allowzero": 1}, num_outputs=1)
    graph.insert_before(before, node)
    out = node.outputs[0]
    out.shape, out.type = ir.Shape(list(shape)), value.type
    return out


def _replace(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    """Every reader of ``old`` reads ``new``; a graph output ``old`` becomes ``new`` under
    ``old``'s name."""
    if old.is_graph_output():
        name = old.name
        for i, v in enumerate(graph.outputs):
            if v is old:
                graph.outputs[i] = new
        old.name = f"{name}_replaced"
        new.name = name
    ir.convenience.replace_all_uses_with(old, new)


# --- products on the token layout -------------------------------------------------------


def flatten_products(graph: ir.Graph) -> int:
    """Rewrite ``Reshape(x) -> product -> Reshape`` with ``x`` of static shape
    ``[..., k]`` flattened to ``[rows, k]`` into the product of ``x`` itself; the count
    of products rewritten."""
    done = 0
    for node in list(graph):
        if (node.domain, node.op_type) not in _PRODUCTS or node.graph is not graph:
            continue
        # FusedMatMul's transA on a 3-d input would transpose each row block instead
        if any(node.attributes.get_int(a, 0) for a in ("transA", "transBatchA", "transBatchB")):
            continue
        flat = node.inputs[0]
        reshape = flat.producer() if flat is not None else None
        if not _is(reshape, "Reshape"):
            continue
        x = reshape.inputs[0]
        x_shape, flat_shape, out_shape = _static(x), _static(flat), _static(node.outputs[0])
        weight = _static(node.inputs[1]) if node.op_type != "MatMulNBits" else (0, 0)
        if None in (x_shape, flat_shape, out_shape, weight) or len(x_shape) < 3 or len(flat_shape) != 2 \
                or len(weight) != 2 or flat_shape != (math.prod(x_shape[:-1]), x_shape[-1]):
            continue
        readers = list(node.outputs[0].uses())
        # (a 0 in a Reshape's target copies the input's size there: the new rank would move it)
        if node.outputs[0].is_graph_output() or not readers or \
                not all(_is(u.node, "Reshape") and u.idx == 0 and 0 not in (_ints(u.node.inputs[1]) or (0,))
                        for u in readers):
            continue
        product = ir.Node(node.domain, node.op_type, [x, *node.inputs[1:]], node.attributes.values(),
                          num_outputs=1, name=f"{node.name}_tokens" if node.name else None)
        graph.insert_before(node, product)
        out = product.outputs[0]
        out.shape, out.type = ir.Shape([*x_shape[:-1], out_shape[-1]]), node.outputs[0].type
        out.name = f"{node.outputs[0].name}_tokens"
        for use in readers:
            after = use.node
            if _static(after.outputs[0]) == _static(out):
                _replace(graph, after.outputs[0], out)
            else:
                after.replace_input_with(0, out)
        done += 1
    return done


# --- attention on the token layout --------------------------------------------------------


def _heads_first(value: ir.Value) -> tuple[ir.Value, ir.Node | None, int] | None:
    """``value`` = [RotaryEmbedding](Transpose(0, 2, 1, 3)(Reshape(x, [b, s, heads, d])))
    with each step read once: (x, the RotaryEmbedding or None, heads)."""
    node = value.producer()
    rotary = None
    if _is(node, "RotaryEmbedding"):
        if len(node.inputs) != 3 or _sole_reader(node.inputs[0]) is not node:
            return None
        rotary, node = node, node.inputs[0].producer()
    if not _swaps_heads(node):
        return None
    reshape = node.inputs[0].producer()
    if not _is(reshape, "Reshape") or _sole_reader(node.inputs[0]) is not node:
        return None
    split = _static(reshape.outputs[0])
    x = reshape.inputs[0]
    if split is None or len(split) != 4 or _static(x) is None or math.prod(_static(x)) != math.prod(split):
        return None
    if rotary is not None and rotary.attributes.get_int("num_heads", split[2]) != split[2]:
        return None
    return x, rotary, split[2]


def _appended(value: ir.Value) -> tuple[ir.Value, ir.Value, ir.Node] | None:
    """``value`` = Concat(past, new, axis=2) of a 4-d cache: (past, new, the Concat)."""
    concat = value.producer()
    if not _is(concat, "Concat") or len(concat.inputs) != 2 or concat.attributes.get_int("axis") not in (2, -2):
        return None
    past, new = concat.inputs
    if past is None or past.shape is None or len(past.shape) != 4 or _sole_reader(new) is not concat:
        return None
    return past, new, concat


def _unrepeated(value: ir.Value) -> ir.Value:
    """The cache under transformers' ``repeat_kv`` (its grouped key/value heads repeated
    for each query head: Unsqueeze(axis 2) -> Expand -> Reshape, each read once), which
    ``Attention`` does itself from ``kv_num_heads`` with the same grouping (query head
    ``i`` reads key/value head ``i // repeats``); ``value`` itself where it is no such
    repeat."""
    reshape = value.producer()
    expand = reshape.inputs[0].producer() if _is(reshape, "Reshape") else None
    unsqueeze = expand.inputs[0].producer() if _is(expand, "Expand") else None
    if not _is(unsqueeze, "Unsqueeze") or _ints(unsqueeze.inputs[1]) not in ((2,), (-3,)) \
            or _sole_reader(expand.inputs[0]) is not expand or _sole_reader(reshape.inputs[0]) is not reshape:
        return value
    cache, wide, out = unsqueeze.inputs[0], expand.outputs[0].shape, value.shape
    if cache.shape is None or wide is None or out is None or len(cache.shape) != 4 or len(wide) != 5 or len(out) != 4:
        return value
    b, kv, t, d = cache.shape.dims
    repeats = wide[2]
    if tuple(wide.dims) != (b, kv, repeats, t, d) or not isinstance(repeats, int) or not isinstance(kv, int) \
            or tuple(out.dims) != (b, kv * repeats, t, d):
        return value
    return cache


def _token_output(value: ir.Value) -> ir.Value | None:
    """The value of ``value`` ([b, heads, s, d]) back on the token layout: the output of
    Transpose(0, 2, 1, 3) -> Reshape([b, s, heads*d] or [b*s, heads*d]) reading it, with
    same-shape Reshapes between skipped, each read once."""
    node = _sole_reader(value)
    while _is(node, "Reshape") and _static(node.outputs[0]) == _static(value):
        value, node = node.outputs[0], _sole_reader(node.outputs[0])
    if not _swaps_heads(node):
        return None
    reshape = _sole_reader(node.outputs[0])
    if not _is(reshape, "Reshape") or _static(reshape.outputs[0]) is None:
        return None
    return reshape.outputs[0]


def attention_on_tokens(graph: ir.Graph) -> int:
    """Rewrite each 4-d ``Attention`` of the pattern in the module docstring to its
    token-layout form with the cache appended inside; the count rewritten."""
    done = 0
    for node in list(graph):
        if node.op_type != "Attention" or node.domain not in ("", "ai.onnx") or node.graph is not graph:
            continue
        if len(node.outputs) != 1 or len(node.inputs) > 4 or node.attributes.get_int("is_causal", 0) != 0 \
                or "q_num_heads" in node.attributes:
            continue
        q = _heads_first(node.inputs[0])
        k_cache, v_cache = _appended(_unrepeated(node.inputs[1])), _appended(_unrepeated(node.inputs[2]))
        if q is None or k_cache is None or v_cache is None:
            continue
        k, v = _heads_first(k_cache[1]), _heads_first(v_cache[1])
        final = _token_output(node.outputs[0])
        shape = _static(node.outputs[0])
        if k is None or v is None or final is None or shape is None or k[2] != v[2] or v[1] is not None:
            continue
        b, heads, s, d = shape
        if q[2] != heads or math.prod(_static(final)) != b * s * heads * d:
            continue
        tokens = []
        for (x, rotary, n) in (q, k):
            x3 = _reshape_to(x, (b, s, n * d), graph, node)
            if rotary is not None:
                attrs = {a.name: a for a in rotary.attributes.values()}
                attrs["num_heads"] = ir.AttrInt64("num_heads", n)
                turned = ir.Node(rotary.domain, "RotaryEmbedding", [x3, *rotary.inputs[1:]], attrs.values(),
                                 num_outputs=1)
                graph.insert_before(node, turned)
                turned.outputs[0].shape, turned.outputs[0].type = ir.Shape([b, s, n * d]), x.type
                x3 = turned.outputs[0]
            tokens.append(x3)
        tokens.append(_reshape_to(v[0], (b, s, v[2] * d), graph, node))
        attrs = {a.name: a for a in node.attributes.values()}
        attrs["q_num_heads"] = ir.AttrInt64("q_num_heads", heads)
        attrs["kv_num_heads"] = ir.AttrInt64("kv_num_heads", k[2])
        mask = node.inputs[3] if len(node.inputs) > 3 else None
        fused = ir.Node(node.domain, "Attention", [*tokens, mask, k_cache[0], v_cache[0]], attrs.values(),
                        num_outputs=3, name=node.name)
        graph.insert_before(node, fused)
        y, present_k, present_v = fused.outputs
        y.shape, y.type = ir.Shape([b, s, heads * d]), node.outputs[0].type
        y.name = f"{node.outputs[0].name}_tokens"
        for present, (_, _, concat) in ((present_k, k_cache), (present_v, v_cache)):
            present.shape, present.type = concat.outputs[0].shape, concat.outputs[0].type
            present.name = f"{concat.outputs[0].name}_present"
            _replace(graph, concat.outputs[0], present)
        out = _reshape_to(y, _static(final), graph, final.producer())
        _replace(graph, final, out)
        done += 1
    return done
