"""torch_lib translations known to give results different from PyTorch's.

Found by lort's op tests (tests/ops/test_ops.py) and the OpInfo conformance sweep
(lort.testing.conformance). A node these rules select stays out of ORT: an op that is
always wrong is decomposed by PyTorch into ops that translate correctly (it is not in
``implemented`` for the decompositions); an op wrong only for some arguments stays in
PyTorch as it is. Asked only by lort.fusion.support.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, Callable

import torch
import torch.fx

from ..translate import attention, exact_scalars


def _node_arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` (positional ``index``) of an FX node."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _is_float_output(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _is_float_arg(node: torch.fx.Node, index: int) -> bool:
    arg = node.args[index] if len(node.args) > index else None
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _arg_shape(node: torch.fx.Node, index: int) -> tuple | None:
    arg = node.args[index] if len(node.args) > index else None
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _arg_dtype(node: torch.fx.Node, index: int) -> torch.dtype | None:
    arg = node.args[index] if len(node.args) > index else None
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _uses_outputs(node: torch.fx.Node, indices: tuple[int, ...]) -> bool:
    """Whether any of the outputs ``indices`` of a multi-output node is used."""
    return any(
        u.target is operator.getitem and u.args[1] in indices and len(u.users) > 0 for u in node.users
    )


def _negative_pad(node: torch.fx.Node) -> bool:
    pads = _node_arg(node, 1, "padding")
    return isinstance(pads, (list, tuple)) and any(not isinstance(p, int) or p < 0 for p in pads)


def _arg_numel(node: torch.fx.Node, index: int) -> int | None:
    shape = _arg_shape(node, index)
    return None if shape is None else math.prod(shape)


def _empty_1d_cat(node: torch.fx.Node) -> bool:
    """cat inputs that torch_lib's cat mishandles. It drops inputs of shape (0,) and, where
    one input is left, returns it (right: a DynamicCache's first update); where none is
    left it fails an assertion, and where two or more are left it concatenates the
    unfiltered list, which ORT refuses when their rank is not 1."""
    tensors = _node_arg(node, 0, "tensors", ())
    shapes = [tuple(t.meta["val"].shape) for t in tensors
              if isinstance(t, torch.fx.Node) and isinstance(t.meta.get("val"), torch.Tensor)]
    rest = [s for s in shapes if s != (0,)]
    if len(rest) == len(shapes):
        return False
    return not rest or (len(rest) >= 2 and any(len(s) != 1 for s in rest))


def _int32_index(node: torch.fx.Node) -> bool:
    indices = _node_arg(node, 1, "indices", ())
    return any(
        isinstance(i, torch.fx.Node) and isinstance(i.meta.get("val"), torch.Tensor)
        and i.meta["val"].dtype == torch.int32
        for i in indices or ()
    )


def _attention_reason(node: torch.fx.Node) -> str | None:
    """Why lort's translation of the CPU attention kernel (translate/attention.py: ONNX's
    Attention, its output only) does not fit ``node``, or None."""
    if _uses_outputs(node, (1,)):
        return "the graph reads the attention kernel's log-sum-exp, which ONNX's Attention does not compute"
    dtypes = {_arg_dtype(node, i) for i in range(3)}
    mask = _node_arg(node, 5, "attn_mask")
    mask_val = mask.meta.get("val") if isinstance(mask, torch.fx.Node) else None
    if dtypes != {torch.float32} or (mask_val is not None and mask_val.dtype not in (torch.bool, torch.float32)):
        return "lort runs attention in ORT for float32 query, key and value, with a bool or float32 mask"
    if any(len(shape or ()) != 4 for shape in (_arg_shape(node, i) for i in range(3))):
        return "ONNX's Attention takes four-dimensional query, key and value here"
    return None


def _when(predicate: Callable[[torch.fx.Node], bool], reason: str) -> Callable:
    """A known-wrong entry for the nodes ``predicate`` selects: those run in PyTorch."""
    return lambda node: reason if predicate(node) else None


@functools.lru_cache(maxsize=1)
def table() -> dict:
    """torch_lib translations that give results different from PyTorch's, found by
    lort's op tests (tests/ops/test_ops.py).

    A value is either a reason: the op is never translated and PyTorch's decomposition of
    it (into ops that translate correctly) is used instead; or a function of the FX node
    giving a reason or None, for ops that are wrong only for some arguments: the nodes it
    gives a reason for are left to PyTorch as they are (not decomposed)."""
    aten = torch.ops.aten
    floor_or_int = (
        lambda n: _node_arg(n, 2, "rounding_mode") == "floor"
        or (_node_arg(n, 2, "rounding_mode") == "trunc" and not _is_float_output(n))
    )
    div_mode = _when(
        floor_or_int,
        "torch_lib's div with rounding_mode computes integer division in float32 (wrong for "
        "|values| > 2**24, e.g. 33554435 // 2 -> 16777218) and float floor division as "
        "floor(a / b), where PyTorch rounds the exact quotient (7.0 // 0.1 is 69, not 70)",
    )
    float_floor = (
        "torch_lib computes float floor division as floor(a / b) and remainder as "
        "a - floor(a / b) * b; PyTorch works from fmod, exactly, so they differ when a / b "
        "rounds to an integer (7.0 // 0.1 is 69 in PyTorch, 70 in ORT; 7.0 % 0.1 is 0.1 vs 0)"
    )
    nan_order = (
        "ORT's TopK does not order NaN as PyTorch's sort/topk do (NaN is the largest value); "
        "float sort/topk run in PyTorch, since NaN is possible in any float input"
    )
    zero_dim_scatter = (
        "ONNX ScatterElements needs inputs of rank >= 1; torch_lib passes 0-d tensors as they "
        "are and ORT fails at run time (median's backward on a 0-d input)"
    )
    embedding_bag = (
        "torch_lib's embedding_bag sums in float32 whatever the dtype (float64 loses precision) "
        "and fills outputs 1-3 (offset2bag, bag_size, max_indices) with zeros of other shapes, "
        "which backward needs (ORT: 'invalid dimensions for output')"
    )
    negative_pad = (
        "ORT's Pad in edge mode fails at run time on negative (cropping) pads: 'Pad: invalid "
        "mode: 2 with zero effective input extent'"
    )
    float_diagonal = (
        "torch_lib's diagonal multiplies the whole (dim1, dim2) plane by an identity mask and "
        "sums it, so an inf or NaN off the diagonal makes the diagonal NaN (inf * 0); lort "
        "decomposes float diagonal/diagonal_copy as a gather (capture/decompositions/indexing.py), "
        "those it cannot (dynamic shapes) run in PyTorch"
    )
    int32_index = _when(
        _int32_index, "torch_lib's index_put passes int32 indices to ScatterND, which takes int64 only"
    )
    return {
        aten._native_batch_norm_legit_functional.default: (
            "torch_lib's training-mode batch norm (ONNX BatchNormalization training_mode=1) "
            "differs from PyTorch's outputs; decomposed instead"
        ),
        aten.nll_loss_forward.default: (
            "torch_lib's nll_loss_forward returns a fake total_weight (the number of "
            "elements of the loss output: 1 for mean/sum reduction) instead of the sum of "
            "the weights of the non-ignored targets, so nll_loss_backward (and cross_entropy's "
            "gradient) is scaled wrongly, e.g. 4x for a batch of 4; decomposed instead"
        ),
        aten.mv.default: (
            "ORT 1.31's Transpose+MatMul fusion (graph optimization level 'extended' and up) "
            "gives wrong results when MatMul's second input is 1-D, as in mv(t(A), x), the "
            "vector gradient of mv and of matmul(matrix, vector); decomposed into mul+sum instead"
        ),
        aten.baddbmm.default: (
            "torch_lib's baddbmm computes beta * input even when beta == 0, so NaN/inf in "
            "input (e.g. a torch.empty buffer) propagate where PyTorch ignores input; decomposed "
            "instead"
        ),
        aten.addmv.default: (
            "torch_lib's addmv computes beta * input even when beta == 0, so NaN/inf in input "
            "propagate where PyTorch ignores input; decomposed instead"
        ),
        aten.addbmm.default: _when(
            lambda n: _node_arg(n, 3, "beta", 1) == 0,
            "torch_lib's addbmm computes beta * input even when beta == 0, so NaN/inf in input "
            "propagate where PyTorch ignores input",
        ),
        aten.atan2.default: _when(
            lambda n: True,
            "torch_lib's atan2 (atan(y / x) with quadrant fix-ups) is wrong for y == 0: "
            "atan2(0, -1) gives -pi instead of pi, and signed zeros are not followed",
        ),
        aten.div.Tensor_mode: div_mode,
        aten.div.Scalar_mode: div_mode,
        aten.floor_divide.default: _when(_is_float_output, float_floor),
        aten.remainder.Tensor: _when(_is_float_output, float_floor),
        aten.remainder.Scalar: _when(_is_float_output, float_floor),
        aten.avg_pool2d.default: _when(
            lambda n: _node_arg(n, 6, "divisor_override") is not None,
            "torch_lib's avg_pool2d ignores divisor_override",
        ),
        aten.avg_pool3d.default: _when(
            lambda n: _node_arg(n, 6, "divisor_override") is not None,
            "torch_lib's avg_pool3d ignores divisor_override",
        ),
        aten.scatter_reduce.two: _when(
            lambda n: _node_arg(n, 4, "reduce") == "mean",
            "torch_lib's scatter_reduce has no 'mean' reduction (ONNX ScatterElements has "
            "none): it scatters without averaging",
        ),
        aten.mean.dim: _when(
            lambda n: not _is_float_arg(n, 0),
            "torch_lib's mean of an integer tensor with dtype= averages in the integer type "
            "(ReduceMean truncates) and casts afterwards",
        ),
        # NaN ordering (lort's NaN decision for sort/topk; see README "NaN semantics").
        aten.sort.default: _when(lambda n: _is_float_arg(n, 0), nan_order),
        aten.sort.stable: _when(lambda n: _is_float_arg(n, 0), nan_order),
        aten.topk.default: _when(lambda n: _is_float_arg(n, 0), nan_order),
        aten.copy.default: _when(
            lambda n: _arg_shape(n, 0) != _arg_shape(n, 1),
            "torch_lib's copy is CastLike(src, self): it does not broadcast src to self's "
            "shape, so ORT fails at run time on copy_(x, y) with y of shape (4, 1) into x (4, 6)",
        ),
        # Found by the OpInfo conformance sweep (lort.testing.conformance).
        aten.special_erfcx.default: (
            "torch_lib's special_erfcx is exp(x**2) * (1 - erf(x)): inf * 0 = NaN from x ~ 9 "
            "(erfcx(30) gives NaN, PyTorch 0.0188) and cancellation from x ~ 3; decomposed (its "
            "prims.erfcx runs in PyTorch)"
        ),
        aten.erfc.default: (
            "torch_lib's erfc is 1 - erf(x), which loses all precision from x ~ 3 (erfc(5) is "
            "1.5e-12, torch_lib gives 0 in float32, so log(erfc(x)) and log_ndtr give -inf); "
            "decomposed (its prims.erfc runs in PyTorch)"
        ),
        aten.special_erfc.default: "torch_lib's special_erfc is 1 - erf(x) (see erfc); decomposed",
        aten.logaddexp.default: (
            "torch_lib's logaddexp is log(exp(a) + exp(b)), which overflows (float32 "
            "logaddexp(500, 500) is inf, PyTorch 500.69; float64 logaddexp(1e300, 1e300) is inf); "
            "decomposed as PyTorch's max + log1p(exp(-|a - b|))"
        ),
        aten.xlogy.Tensor: (
            "torch_lib's xlogy is where(x == 0, 0, x * log(y)): 0 for x = 0 and y NaN, PyTorch NaN; "
            "decomposed"
        ),
        aten.heaviside.default: (
            "torch_lib's heaviside gives 1 for a NaN input, PyTorch 0; decomposed"
        ),
        aten.logaddexp2.default: (
            "torch_lib's logaddexp2 is log2(2**a + 2**b), which overflows (see logaddexp); decomposed"
        ),
        aten.signbit.default: _when(
            lambda n: _is_float_arg(n, 0) or _arg_shape(n, 0) == (),
            "torch_lib's signbit is x < 0: False for -0.0 (and for a NaN with its sign bit set), "
            "and it compares with a constant of shape [1], so a 0-d input gives a 1-d output",
        ),
        aten.logcumsumexp.default: _when(
            lambda n: _is_float_arg(n, 0),
            "torch_lib's logcumsumexp subtracts the max of the whole dimension before a cumsum of "
            "exp, so exp underflows to 0 before a large element (float32 logcumsumexp([0, 500]) "
            "gave [-inf, 500]); lort's decomposition (capture/decompositions/ops.py) covers "
            "dimensions up to 1024, longer ones run in PyTorch",
        ),
        aten.diagonal.default: _when(lambda n: _is_float_arg(n, 0), float_diagonal),
        aten.diagonal_copy.default: _when(lambda n: _is_float_arg(n, 0), float_diagonal),
        aten.scatter.src: _when(lambda n: _arg_shape(n, 0) == (), zero_dim_scatter),
        aten.scatter.value: _when(lambda n: _arg_shape(n, 0) == (), zero_dim_scatter),
        aten.scatter_add.default: _when(lambda n: _arg_shape(n, 0) == (), zero_dim_scatter),
        aten._native_batch_norm_legit_no_training.default: _when(
            lambda n: _uses_outputs(n, (1, 2)) or _arg_dtype(n, 0) == torch.float64,
            "torch_lib's inference batch norm gives the running stats as outputs 1 and 2, where "
            "PyTorch gives empty tensors (ORT: 'invalid dimensions for output'), and its float64 "
            "model does not type-check in ORT",
        ),
        aten._embedding_bag.default: _when(lambda n: True, embedding_bag),
        aten._embedding_bag_forward_only.default: _when(lambda n: True, embedding_bag),
        aten.embedding_bag.padding_idx: _when(lambda n: True, embedding_bag),
        aten.replication_pad1d.default: _when(_negative_pad, negative_pad),
        aten.replication_pad2d.default: _when(_negative_pad, negative_pad),
        aten.replication_pad3d.default: _when(_negative_pad, negative_pad),
        aten._linalg_det.default: (
            "torch_lib translates _linalg_det as Det alone, where the op returns (det, LU, "
            "pivots): the group's model fails to type-check in ORT; runs in PyTorch"
        ),
        aten.cat.default: _when(
            _empty_1d_cat,
            "torch_lib's cat drops inputs of shape (0,) (PyTorch's legacy rule), then fails an "
            "assertion when none is left, and concatenates the unfiltered list when two or more "
            "are left, which ORT refuses beside inputs of another rank",
        ),
        aten.im2col.default: _when(
            lambda n: _arg_numel(n, 0) == 0,
            "torch_lib's im2col reshapes with -1, which ORT rejects for an input with no "
            "elements ('Invalid Target shape product of 0')",
        ),
        aten._unsafe_index_put.default: int32_index,
        aten.index_put.default: int32_index,
        aten.gelu.default: _when(
            lambda n: _arg_dtype(n, 0) == torch.float64 and _node_arg(n, 1, "approximate") == "tanh",
            "float64 gelu(approximate='tanh') through torch_lib and ORT is off by ~1e-7 relative "
            "(float32 precision: 1.963192137 where PyTorch gives 1.963192349)",
        ),
        attention.FLASH_FOR_CPU: _attention_reason,
    }


def reason(node: torch.fx.Node) -> str | None:
    """Why torch_lib's translation of ``node`` would be wrong, or None."""
    wrong = table().get(node.target)
    if callable(wrong):
        wrong = wrong(node)
    # A Python float of a float64 graph that the translation would round to float32
    # (translate/exact_scalars.py translates the others exactly).
    return wrong or exact_scalars.float64_scalar_reason(node)


def always_wrong() -> set:
    """The ops whose translation is wrong for every argument (decomposed instead)."""
    return {op for op, why in table().items() if isinstance(why, str)}
