"""Quantization of frozen weights (Options.quantize): each product of an activation by a
frozen float32 weight matrix (a linear layer's ``Transpose(W) -> Gemm``, GPT-2's
``Gemm(x, W)``, a ``MatMul`` or onnxscript's ``FusedMatMul`` by a weight) becomes, with the
bias added after:

- "int4", "int8" (weight-only): ORT's ``com.microsoft.MatMulNBits`` over the weight
  quantized in blocks along K. The numbers come from onnxruntime's own quantizer
  (``DefaultWeightOnlyQuantizer.qbits_block_quant``, its C++ kernels).
- "int8_dynamic": ORT's ``com.microsoft.DynamicQuantizeMatMul``, which quantizes its
  activation per call and multiplies in integers, over uint8 weights with a scale and
  zero point per output column: onnxruntime's ``quant_utils.quantize_data`` per column
  (as its per-channel quantizer calls it), in one vectorized pass (_per_column_uint8;
  a test checks it against quantize_data).

lort only finds the products in its graph, which it knows. Inference only: a quantized
weight has no gradient. The quantized arrays become the session's initializers
(external data, owned like frozen weights); the float32 weight leaves the session."""

from __future__ import annotations

import dataclasses
import logging
import weakref

import numpy as np
import onnx_ir as ir
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..options import Options
from ..runtime import offload
from ..translate.external_data import initializer

logger = logging.getLogger("lort")

#: Options.quantize -> bits per weight.
BITS = {"int4": 4, "int8": 8, "int8_dynamic": 8}
_MS_DOMAIN = "com.microsoft"


@dataclasses.dataclass
class QuantizeResult:
    """What a rewrite did: products quantized, float32 bytes they held, and bytes of the
    quantized weights, scales and zero points that replace them."""

    products: int = 0
    float_bytes: int = 0
    quantized_bytes: int = 0
    #: Products computed by another's node (JOIN_PRODUCTS): products - joined nodes.
    joined: int = 0
    #: Bytes moved to files (Options.quantize_offload_dir) by this rewrite.
    offloaded_bytes: int = 0


def _quantizer(options: Options):
    """A function of a [K, N] float32 array -> (quantized weights, scales, zero points)
    as the scheme's ORT operator takes them."""
    if options.quantize == "int8_dynamic":
        return lambda w_kn: _per_column_uint8(w_kn, options.quantize_symmetric)
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    config = DefaultWeightOnlyQuantConfig(
        block_size=options.quantize_block_size, is_symmetric=options.quantize_symmetric,
        accuracy_level=options.quantize_accuracy_level, bits=BITS[options.quantize])
    return DefaultWeightOnlyQuantizer(config).qbits_block_quant


def _per_column_uint8(w_kn: np.ndarray, symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``w_kn`` quantized to uint8 per column: ([K, N] uint8, [N] float32 scales, [N]
    uint8 zero points), the numbers of onnxruntime's ``quantize_data(column, UINT8,
    symmetric)`` (compute_scale_zp, quantize_nparray) for every column at once; its own
    loop over columns takes about a second per BERT-base feed-forward matrix."""
    rmin = np.minimum(w_kn.min(axis=0), np.float32(0))
    rmax = np.maximum(w_kn.max(axis=0), np.float32(0))
    if symmetric:
        rmax = np.maximum(-rmin, rmax)
        rmin = -rmax
    scale64 = (rmax.astype(np.float64) - rmin.astype(np.float64)) / 255.0
    flat = scale64 < np.finfo(np.float32).tiny  # an all-zero column: ORT's scale 1, zero point 0
    safe = np.where(flat, 1.0, scale64)
    zero_point = np.full(rmin.shape, 128.0) if symmetric else np.round(-rmin / safe)
    zero_point = np.where(flat, 0.0, zero_point).astype(np.uint8)
    scale = np.where(flat, 1.0, scale64).astype(np.float32)
    q = np.round(w_kn.astype(np.float32) / scale) + zero_point
    return np.clip(q, 0, 255).astype(np.uint8), scale, zero_point


def _float_matrix(value: ir.Value | None) -> np.ndarray | None:
    """The float32 2-D array an initializer holds, or None."""
    if value is None or not value.is_initializer() or value.const_value is None:
        return None
    tensor = value.const_value
    if tensor.dtype != ir.DataType.FLOAT or len(tensor.shape) != 2:
        return None
    return tensor.numpy()


def _weight_kn(node: ir.Node) -> tuple[np.ndarray, ir.Value, ir.Node | None, bool] | None:
    """The product's weight as a [K, N] array, the initializer holding it, the Transpose
    between them (or None), and whether the array is the initializer transposed; None
    where ``node`` is no product by a frozen float32 matrix in a form MatMulNBits
    computes."""
    attrs = node.attributes
    if node.domain == _MS_DOMAIN and node.op_type == "FusedMatMul":  # onnxscript's fusion of Transpose + MatMul
        if attrs.get_int("transBatchA", 0) or attrs.get_int("transBatchB", 0):
            return None
    elif node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm"):
        return None
    # Gemm's and FusedMatMul's attributes (a MatMul has none: the defaults hold)
    if attrs.get_int("transA", 0) or attrs.get_float("alpha", 1.0) != 1.0:
        return None
    if node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None \
            and attrs.get_float("beta", 1.0) != 1.0:
        return None
    trans_b = attrs.get_int("transB", 0)
    b = node.inputs[1]
    array = _float_matrix(b)
    if array is not None:
        return (array.T if trans_b else array), b, None, bool(trans_b)
    producer = b.producer() if b is not None else None
    if producer is None or producer.op_type != "Transpose" or producer.domain not in ("", "ai.onnx"):
        return None
    if list(producer.attributes.get_ints("perm", [1, 0])) != [1, 0] or len(b.uses()) != 1:
        return None
    array = _float_matrix(producer.inputs[0])
    if array is None:
        return None
    return (array if trans_b else array.T), producer.inputs[0], producer, not trans_b


#: Products that read one activation (a layer's q, k and v; a feed-forward's gate and up)
#: become one node over their weights side by side along N, its output cut back by a
#: Split, as ORT GenAI's model builder writes them: one pass over the activation, and for
#: int8 compute one quantization of it. Column-wise schemes make the joined arrays the
#: members' arrays side by side. False only for studies that time the two forms.
JOIN_PRODUCTS = True


@dataclasses.dataclass
class _Product:
    """A product by a frozen weight matrix, as ``_weight_kn`` found it."""

    node: ir.Node
    w_kn: np.ndarray
    weight: ir.Value
    transpose: ir.Node | None
    transposed: bool

    @property
    def bias(self) -> ir.Value | None:
        """A Gemm's bias, added after the quantized product."""
        node = self.node
        return node.inputs[2] if node.op_type == "Gemm" and len(node.inputs) > 2 else None


def _joined(products: list[_Product]) -> list[list[_Product]]:
    """The products in runs to compute as one node: those reading the same activation
    with the same K (in graph order), each other product alone."""
    runs: dict[tuple, list[_Product]] = {}
    for p in products:
        # the joined node takes the first member's place: a bias some node computes (not
        # an initializer or graph input) could come after it, so its product stays alone
        computed = p.bias is not None and p.bias.producer() is not None
        key = (p.node.inputs[0], p.w_kn.shape[0]) if JOIN_PRODUCTS and not computed else (p.node,)
        runs.setdefault(key, []).append(p)
    return list(runs.values())


#: id(first weight tensor) -> (a weak reference to it, {(transposed flags, scheme
#: settings, the tensors' versions, the other tensors' ids): (arrays, weak references to
#: the other tensors)}): a weight (or a run of joined weights) quantized once for all the
#: graphs that freeze it (a decoder's prefill and decode graphs), released with the
#: weight. By identity: tensors compare by value (under FakeTensorMode, not at all).
_quantized: dict[int, tuple[weakref.ref, dict]] = {}


def _settings(options: Options) -> tuple:
    block = None if options.quantize == "int8_dynamic" else options.quantize_block_size
    return (options.quantize, block, options.quantize_symmetric)


def _quantized_arrays(quantizer, run: list[_Product], sources: list[torch.Tensor | None], options: Options,
                      result: QuantizeResult):
    """(packed, scales, zero points) of the run's weights side by side along N, from the
    cache where ``sources`` (the weight tensors they were read from) were quantized alike
    at their current versions."""
    cacheable = all(s is not None for s in sources)
    first, others = sources[0], sources[1:]
    key = (tuple(p.transposed for p in run), _settings(options), tuple(s._version for s in sources),
           tuple(id(s) for s in others)) if cacheable else None
    held = _quantized.get(id(first)) if cacheable else None
    if held is not None and held[0]() is first and key in held[1]:
        arrays, refs = held[1][key]
        if all(r() is s for r, s in zip(refs, others)):
            return arrays
    w_kn = run[0].w_kn if len(run) == 1 else np.concatenate([p.w_kn for p in run], axis=1)
    arrays = tuple(np.ascontiguousarray(a) for a in quantizer()(np.ascontiguousarray(w_kn, dtype=np.float32)))
    if options.quantize_offload_dir is not None and cacheable:
        result.offloaded_bytes += _offload(sources, arrays, options.quantize_offload_dir)
    if cacheable:
        if held is None or held[0]() is not first:
            ident = id(first)
            held = (weakref.ref(first, lambda _, ident=ident: _quantized.pop(ident, None)), {})
            _quantized[ident] = held
        held[1].clear()  # an older version or other settings: not wanted again
        held[1][key] = (arrays, tuple(weakref.ref(s) for s in others))
    return arrays


def _offload(sources: list[torch.Tensor], arrays: tuple, directory: str) -> int:
    """Move the float32 weights ``sources`` (their storage: ORT runs the quantized copy,
    and a later graph finds the arrays in the cache) and their quantized ``arrays`` (read
    again only by each session's pre-packing, after which runtime/session.py pages them
    out) to files in ``directory`` (Options.quantize_offload_dir)."""
    moved = sum(_offload_storage(s, directory) for s in sources)
    for a in arrays:
        moved += offload.offload(a, a.ctypes.data, a.nbytes, directory)
    return moved


def _offload_storage(t: torch.Tensor, directory: str) -> int:
    with unset_fake_temporarily():
        storage = t.untyped_storage()
        return offload.offload(t, storage.data_ptr(), storage.nbytes(), directory)


def _product_node(graph: ir.Graph, run: list[_Product], arrays: tuple, options: Options) -> tuple[ir.Node, list]:
    """The quantized product of a run (its first member's input by the arrays) and the
    initializers it takes."""
    packed, scales, zero_points = arrays
    first = run[0].node
    k = run[0].w_kn.shape[0]
    n = sum(p.w_kn.shape[1] for p in run)
    base = run[0].weight.name or f"w{id(first)}"
    inputs = [first.inputs[0], initializer(graph, f"{base}_q{BITS[options.quantize]}", packed),
              initializer(graph, f"{base}_scales", scales)]
    dynamic = options.quantize == "int8_dynamic"
    if dynamic or not options.quantize_symmetric:  # int8_dynamic's symmetric zero point is 128
        inputs.append(initializer(graph, f"{base}_zero_points", zero_points))
    if dynamic:
        return ir.Node(_MS_DOMAIN, "DynamicQuantizeMatMul", inputs, name=f"{first.name}_dq"), inputs[1:]
    attributes = [ir.AttrInt64("K", k), ir.AttrInt64("N", n), ir.AttrInt64("bits", BITS[options.quantize]),
                  ir.AttrInt64("block_size", options.quantize_block_size)]
    if options.quantize_accuracy_level:
        attributes.append(ir.AttrInt64("accuracy_level", options.quantize_accuracy_level))
    return ir.Node(_MS_DOMAIN, "MatMulNBits", inputs, attributes, name=f"{first.name}_nbits"), inputs[1:]


def _replace(graph: ir.Graph, run: list[_Product], product: ir.Node) -> None:
    """Put ``product`` in place of the run's nodes: its output, or a Split of it per
    member, each with its Gemm's bias added after."""
    new_nodes = [product]
    outs = list(product.outputs)
    if len(run) > 1:
        sizes = initializer(graph, f"{product.name}_split", np.array([p.w_kn.shape[1] for p in run], dtype=np.int64))
        split = ir.Node("", "Split", [outs[0], sizes], attributes=[ir.AttrInt64("axis", -1)],
                        num_outputs=len(run), name=f"{product.name}_split")
        new_nodes.append(split)
        outs = list(split.outputs)
    for i, p in enumerate(run):
        node = p.node
        if p.bias is not None:
            add = ir.Node("", "Add", [outs[i], p.bias], name=f"{node.name}_bias")
            new_nodes.append(add)
            outs[i] = add.outputs[0]
        outs[i].shape, outs[i].type = node.outputs[0].shape, node.outputs[0].type
    ir.convenience.replace_nodes_and_values(graph, run[0].node, [p.node for p in run], new_nodes,
                                            [p.node.outputs[0] for p in run], outs)
    for p in run:
        if p.transpose is not None and not p.transpose.outputs[0].uses():
            graph.remove(p.transpose, safe=True)
        if not p.weight.uses() and p.weight not in graph.outputs:
            graph.initializers.pop(p.weight.name, None)


def quantize_products(model: ir.Model, options: Options, sources: dict[str, torch.Tensor] | None = None
                      ) -> QuantizeResult:
    """Rewrite ``model`` in place: every product by a frozen float32 weight matrix
    becomes MatMulNBits (DynamicQuantizeMatMul for "int8_dynamic"; products of one
    activation joined into one node, JOIN_PRODUCTS) and an Add for a Gemm's bias.
    Products whose weight is not an initializer (weights kept as inputs) are left as they
    are. ``sources``: initializer name -> the weight tensor it holds, whose quantized
    arrays are then shared by every graph that freezes it."""
    result = QuantizeResult()
    if options.quantize is None:
        return result
    graph = model.graph
    made: list = []

    def quantizer():
        if not made:
            made.append(_quantizer(options))
        return made[0]

    products = [_Product(node, *found) for node in graph if (found := _weight_kn(node)) is not None]
    for run in _joined(products):
        arrays = _quantized_arrays(quantizer, run, [(sources or {}).get(p.weight.name) for p in run], options,
                                   result)
        product, inputs = _product_node(graph, run, arrays, options)
        _replace(graph, run, product)
        result.products += len(run)
        result.joined += len(run) - 1
        result.float_bytes += sum(p.w_kn.size * 4 for p in run)
        result.quantized_bytes += sum(v.const_value.nbytes for v in inputs)
    if result.products:
        model.opset_imports.setdefault(_MS_DOMAIN, 1)
        logger.info("lort: quantized %d product(s) to %s in %d node(s): %.1f MiB of float32 weights -> %.1f MiB",
                    result.products, options.quantize, result.products - result.joined,
                    result.float_bytes / 2**20, result.quantized_bytes / 2**20)
        if options.quantize_offload_dir is not None:
            result.offloaded_bytes += _offload_lookup_tables(graph, sources or {}, options.quantize_offload_dir)
            if result.offloaded_bytes:  # (a later graph of the model finds its weights offloaded already)
                logger.info("lort: %.1f MiB offloaded to %s (float32 weights quantized, their arrays, lookup "
                            "tables)", result.offloaded_bytes / 2**20, options.quantize_offload_dir)
    return result


def _offload_lookup_tables(graph: ir.Graph, sources: dict[str, torch.Tensor], directory: str) -> int:
    """Offload the frozen weights the graph only looks rows up in (``Gather``'s data: an
    embedding table, of which a call reads the rows of its tokens); the bytes moved."""
    moved = 0
    for value in graph.initializers.values():
        uses = value.uses()
        source = sources.get(value.name)
        if source is not None and uses and all(u.node.op_type == "Gather" and u.idx == 0 for u in uses):
            moved += _offload_storage(source, directory)
    return moved

