"""Decompositions of single ops whose torch_lib translation fails on some inputs, into
ops it translates exactly (registered by ``decompositions.table``).

* Reductions over a dimension of a 0-d tensor: ONNX's ReduceMax/ReduceMin reject an
  axis on a rank-0 input ("axis must be in [-rank, rank-1]. Input rank was 0"), so
  torch_lib's amax/amin and any/all with a dim failed to build. On a 0-d tensor amax and
  amin are the value itself and any/all are ``x != 0``.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def _zero_dim(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 0


def _chain(fn, previous):
    """``fn``, falling back to ``previous`` (an earlier decomposition of the same op, or
    none) where ``fn`` returns NotImplemented."""
    if previous is None:
        return fn

    def decomposition(*args, **kwargs):
        out = fn(*args, **kwargs)
        return previous(*args, **kwargs) if out is NotImplemented else out

    decomposition.__name__ = fn.__name__
    return decomposition


def zero_dim_extremum(x, dim=(), keepdim=False):
    """amax/amin of a 0-d tensor over dim [], 0 or -1: the value (NaN included)."""
    if not _zero_dim(x):
        return NotImplemented
    return aten.clone.default(x)


def zero_dim_any_all(x, dim=None, keepdim=False):
    """any/all of a 0-d tensor over a dim: whether the value is nonzero (NaN is). uint8
    inputs (whose any/all are uint8) are left alone."""
    if not _zero_dim(x) or x.dtype == torch.uint8:
        return NotImplemented
    if x.dtype == torch.bool:
        return aten.clone.default(x)
    return aten.ne.Scalar(x, 0)


def _pytorch_decomposition(op, *args):
    """PyTorch's own decomposition of ``op`` (torch._decomp), applied to ``args``."""
    from torch._decomp import decomposition_table

    return decomposition_table[op](*args)


def table(previous: dict) -> dict:
    """lort's single-op decompositions; each falls back to ``previous``'s decomposition
    of the same op where it does not apply."""
    own = {
        aten.amax.default: zero_dim_extremum,
        aten.amin.default: zero_dim_extremum,
        aten.any.dim: zero_dim_any_all,
        aten.any.dims: zero_dim_any_all,
        aten.all.dim: zero_dim_any_all,
        aten.all.dims: zero_dim_any_all,
        aten.max.dim: bool_max_min_dim(aten.max.dim),
        aten.min.dim: bool_max_min_dim(aten.min.dim),
        aten.trunc.default: integer_rounding,
        aten.floor.default: integer_rounding,
        aten.ceil.default: integer_rounding,
        aten.round.default: integer_rounding,
        aten.angle.default: integer_angle,
        torch.ops.prims.prod.default: prims_prod,
        aten.hardtanh_backward.default: hardtanh_backward,
        aten.native_layer_norm.default: float64_native_layer_norm,
        aten.pixel_shuffle.default: integer_pixel_shuffle,
        aten._log_softmax.default: float64_log_softmax,
        aten.logsumexp.default: nan_propagating_logsumexp,
        aten.pow.Tensor_Scalar: square_root_powers,
        aten.isinf.default: compare_to_infinity("isinf", lambda x: aten.eq.Scalar(aten.abs.default(x), math.inf)),
        aten.isposinf.default: compare_to_infinity("isposinf", lambda x: aten.eq.Scalar(x, math.inf)),
        aten.isneginf.default: compare_to_infinity("isneginf", lambda x: aten.eq.Scalar(x, -math.inf)),
    }
    return {op: _chain(fn, previous.get(op)) for op, fn in own.items()}


def bool_max_min_dim(op):
    """max.dim/min.dim of a bool tensor (cumprod's backward finds its first zero so) as the
    op on int32: ONNX's ArgMax/ArgMin take no bool. Values are cast back to bool."""

    def decomposition(x, dim, keepdim=False):
        if x.dtype != torch.bool:
            return NotImplemented
        values, indices = op(aten._to_copy.default(x, dtype=torch.int32), dim, keepdim)
        return aten._to_copy.default(values, dtype=torch.bool), indices

    decomposition.__name__ = f"bool_{op.__name__.replace('.', '_')}"
    return decomposition


def integer_rounding(x):
    """trunc/floor/ceil/round of an integer or bool tensor: the values themselves (ONNX's
    Floor/Ceil/Round take floats only)."""
    if x.dtype.is_floating_point or x.dtype.is_complex:
        return NotImplemented
    return aten.clone.default(x)


def integer_angle(x):
    """angle of an integer or bool tensor: pi where it is negative, else 0, in the default
    float dtype (torch_lib's translation kept the integer output type and failed)."""
    if x.dtype.is_floating_point or x.dtype.is_complex:
        return NotImplemented
    dtype = torch.get_default_dtype()
    negative = aten._to_copy.default(aten.lt.Scalar(x, 0), dtype=dtype)
    return aten.mul.Tensor(negative, aten.scalar_tensor.default(math.pi, dtype=dtype, device=x.device))


def prims_prod(x, dims, *, output_dtype=None):
    """prims.prod (PyTorch's cumprod decomposition reduces with it; torch_lib has no
    translation) as aten.prod over each dim, the last first."""
    out = x
    for dim in sorted({d % max(x.dim(), 1) for d in dims}, reverse=True):
        out = aten.prod.dim_int(out, dim) if x.dim() > 0 else aten.clone.default(out)
    if not dims:
        out = aten.clone.default(out)
    if output_dtype is not None and out.dtype != output_dtype:
        out = aten._to_copy.default(out, dtype=output_dtype)
    return out


def hardtanh_backward(grad_output, x, min_val, max_val):
    """PyTorch's kernel, ``grad where min_val < x < max_val, else 0`` (0 for NaN inputs):
    torch_lib's translation multiplied a float64 gradient by a float32 mask and failed
    to build."""
    inside = aten.logical_and.default(aten.gt.Scalar(x, min_val), aten.lt.Scalar(x, max_val))
    return aten.masked_fill.Scalar(grad_output, aten.logical_not.default(inside), 0)


def float64_native_layer_norm(x, normalized_shape, weight, bias, eps):
    """native_layer_norm of float64 as PyTorch's own decomposition (var_mean, rsqrt):
    torch_lib's LayerNormalization gives float32 mean and rstd, and its group failed to
    build (output type double expected)."""
    if x.dtype != torch.float64:
        return NotImplemented
    return _pytorch_decomposition(aten.native_layer_norm.default, x, normalized_shape, weight, bias, eps)


def integer_pixel_shuffle(x, upscale_factor):
    """pixel_shuffle of a non-float tensor as PyTorch's decomposition (reshape, permute,
    copy): ORT has no integer DepthToSpace kernel."""
    if x.dtype.is_floating_point or x.dtype.is_complex:
        return NotImplemented
    return _pytorch_decomposition(aten.pixel_shuffle.default, x, upscale_factor)


def compare_to_infinity(name: str, compare):
    """isinf/isposinf/isneginf of a floating tensor as ``compare``, a comparison with
    infinity in the tensor's own dtype: torch_lib casts the input to float32 first, so a
    float64 1e300 counted as infinite. Other dtypes are left to the op."""

    def decomposition(x):
        return compare(x) if x.dtype.is_floating_point else NotImplemented

    decomposition.__name__ = f"{name}_compared_to_infinity"
    return decomposition


def float64_log_softmax(x, dim, half_to_float):
    """log_softmax of float64 as PyTorch's decomposition (x - amax - log(sum(exp))), whose
    amax lort makes NaN-propagating: ORT's float64 LogSoftmax kernel mishandles NaN and
    inf (log_softmax([1, nan, 2]) gave [45.05, nan, 46.05], PyTorch all NaN)."""
    if x.dtype != torch.float64:
        return NotImplemented
    return _pytorch_decomposition(aten._log_softmax.default, x, dim, half_to_float)


def square_root_powers(x, exponent):
    """pow(x, 0.5) and pow(x, -0.5) of a floating tensor as sqrt and rsqrt, as PyTorch's
    kernel computes them: ONNX's Pow follows C's pow, so pow(-inf, 0.5) was inf (PyTorch
    NaN) and pow(-0.0, 0.5) was 0.0 (PyTorch -0.0)."""
    if not x.dtype.is_floating_point or exponent not in (0.5, -0.5):
        return NotImplemented
    return aten.sqrt.default(x) if exponent == 0.5 else aten.rsqrt.default(x)


def nan_propagating_logsumexp(x, dim, keepdim=False):
    """logsumexp as PyTorch's decomposition (amax, which lort makes NaN-propagating, then
    log(sum(exp))): torch_lib's gave inf where the values hold both NaN and inf (PyTorch
    NaN), ORT's ReduceMax not propagating NaN. A 0-d input is left to torch_lib (the
    value itself)."""
    if x.dim() == 0 or not x.dtype.is_floating_point:
        return NotImplemented
    return _pytorch_decomposition(aten.logsumexp.default, x, dim, keepdim)
