"""Decompositions of single ops whose torch_lib translation fails on some inputs, into
ops it translates exactly, or whose PyTorch decomposition ORT runs poorly (registered by
``decompositions.table``).

* matmul of a batch by a matrix (``matmul_folded``): one matrix product over the
  batch's rows, also for a non-contiguous batch.

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


def chain(fn, previous):
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


def matmul_folded(a, b):
    """``a @ b`` for ``a`` of 3 or more dims and ``b`` a matrix, as one matrix product over
    the rows of ``a``. PyTorch's decomposition folds a non-contiguous ``a`` (a transposed
    activation: nn.MultiheadAttention's projections with batch_first) only where ``b``
    requires grad; under torch.export without grad it broadcasts ``b`` to a batch and
    calls bmm, which ORT runs as one small product per batch over ``b`` copied that many
    times. Other shapes: PyTorch's decomposition."""
    if a.dim() >= 3 and b.dim() == 2:
        rows = aten.reshape.default(a, [-1, a.shape[-1]])
        return aten.view.default(aten.mm.default(rows, b), [*a.shape[:-1], b.shape[-1]])
    from torch._decomp import decompositions as torch_decompositions

    return torch_decompositions.matmul(a, b)


def table(previous: dict) -> dict:
    """lort's single-op decompositions; each falls back to ``previous``'s decomposition
    of the same op where it does not apply."""
    own = {
        aten.matmul.default: matmul_folded,
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
        aten.angle.default: chain(float_angle, integer_angle),
        torch.ops.prims.prod.default: prims_prod,
        aten.hardtanh_backward.default: hardtanh_backward,
        aten.native_layer_norm.default: float64_native_layer_norm,
        aten.leaky_relu.default: float64_leaky_relu,
        aten.leaky_relu_backward.default: float64_leaky_relu_backward,
        aten.pixel_shuffle.default: integer_pixel_shuffle,
        aten._log_softmax.default: float64_log_softmax,
        aten.logsumexp.default: nan_propagating_logsumexp,
        aten.pow.Tensor_Scalar: square_root_powers,
        aten.clamp.default: one_sided_clamp,
        aten.clamp_min.default: lambda x, low: one_sided_clamp(x, low, None),
        aten.clamp_max.default: lambda x, high: one_sided_clamp(x, None, high),
        aten.clamp_min.Tensor: lambda x, low: zero_dim_bound(aten.maximum.default, x, low),
        aten.clamp_max.Tensor: lambda x, high: zero_dim_bound(aten.minimum.default, x, high),
        aten.logcumsumexp.default: logcumsumexp_over_pairs,
        aten.linalg_vector_norm.default: infinity_norm,
        aten.log1p.default: accurate_log1p,
        aten.isinf.default: compare_to_infinity("isinf", lambda x: aten.eq.Scalar(aten.abs.default(x), math.inf)),
        aten.isposinf.default: compare_to_infinity("isposinf", lambda x: aten.eq.Scalar(x, math.inf)),
        aten.isneginf.default: compare_to_infinity("isneginf", lambda x: aten.eq.Scalar(x, -math.inf)),
        aten._to_copy.default: real_to_complex,
    }
    return {op: chain(fn, previous.get(op)) for op, fn in own.items()}


_COMPLEX_PARTS = {torch.complex64: torch.float32, torch.complex128: torch.float64}


def real_to_complex(x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
                    memory_format=None):
    """A contiguous real tensor made complex (``x.to(torch.complex64)``, as torch.fft.fft
    of a real input does) as ``view_as_complex(stack([x, 0], -1))``: ops ORT runs on
    lort's float pairs (fusion/support.py), where torch_lib's _to_copy would cast to an
    ONNX complex type ORT does not compute with."""
    part = _COMPLEX_PARTS.get(dtype)
    if (part is None or x.dtype.is_complex or not x.is_contiguous() or layout not in (None, torch.strided)
            or device not in (None, x.device) or pin_memory or memory_format not in (None, torch.preserve_format)):
        return NotImplemented
    real = x if x.dtype == part else aten._to_copy.default(x, dtype=part)
    return aten.view_as_complex.default(aten.stack.default([real, aten.zeros_like.default(real)], -1))


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


def float_angle(x):
    """angle of a floating tensor: pi where it is negative, else 0, and NaN where it is
    NaN, as PyTorch's (torch_lib's where(x < 0, pi, 0) gave 0 for NaN)."""
    if not x.dtype.is_floating_point:
        return NotImplemented
    negative = aten._to_copy.default(aten.lt.Scalar(x, 0), dtype=x.dtype)
    angle = aten.mul.Tensor(negative, aten.scalar_tensor.default(math.pi, dtype=x.dtype, device=x.device))
    return aten.where.self(aten.isnan.default(x), x, angle)


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


def float64_leaky_relu(x, negative_slope=0.01):
    """leaky_relu of float64 as PyTorch's decomposition (where, mul by the slope as an
    exact float64 scalar): torch_lib writes the slope as ONNX's float32 attribute."""
    if x.dtype != torch.float64:
        return NotImplemented
    return _pytorch_decomposition(aten.leaky_relu.default, x, negative_slope)


def float64_leaky_relu_backward(grad, x, negative_slope, self_is_result):
    """leaky_relu_backward of float64 as PyTorch's decomposition (see float64_leaky_relu)."""
    if x.dtype != torch.float64:
        return NotImplemented
    return _pytorch_decomposition(aten.leaky_relu_backward.default, grad, x, negative_slope, self_is_result)


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


def one_sided_clamp(x, min=None, max=None):
    """clamp of a floating tensor with one bound as clamp with the other bound infinite:
    torch_lib gives ONNX Clip no other bound, and ORT's Clip then clamps to the dtype's
    largest finite value, so clamp_min(inf, 1e-12) was 3.4e38 (PyTorch inf; normalize
    gave 3e38 / 3.4e38 = 0.88 where PyTorch gives 0)."""
    if not x.dtype.is_floating_point or (min is None) == (max is None):
        return NotImplemented
    low = -math.inf if min is None else min
    high = math.inf if max is None else max
    # An int bound beside an infinite one matches no overload of torch_lib's clamp.
    low, high = (float(v) if isinstance(v, int) else v for v in (low, high))
    return aten.clamp.default(x, low, high)


def zero_dim_bound(op, x, bound):
    """clamp_min/clamp_max of a floating tensor by a 0-d tensor of its dtype as ``op``
    (maximum/minimum, which propagate NaN as clamp does): torch_lib uses Clip with one
    bound there (see one_sided_clamp)."""
    if not x.dtype.is_floating_point or bound.dim() != 0 or bound.dtype != x.dtype:
        return NotImplemented
    return op(x, bound)


#: The longest dimension logcumsumexp_over_pairs writes as all pairs (L * L per row).
LOGCUMSUMEXP_MAX_LENGTH = 1024


def logcumsumexp_over_pairs(x, dim):
    """logcumsumexp of a floating tensor as a logsumexp over all pairs j <= i (the others
    masked to -inf), which lort makes NaN-propagating: torch_lib's subtracts the max of the
    whole dimension before a cumsum of exp, so exp underflows to 0 for the elements before
    a large one (float32 logcumsumexp([0, 500]) gave [-inf, 500], PyTorch [0, 500]).
    Dimensions longer than LOGCUMSUMEXP_MAX_LENGTH are left to the op (known wrong: it
    runs in PyTorch)."""
    if not x.dtype.is_floating_point or x.dim() == 0 or x.shape[dim] > LOGCUMSUMEXP_MAX_LENGTH:
        return NotImplemented
    moved = aten.movedim.int(x, dim, -1)
    length = moved.shape[-1]
    rows = aten.unsqueeze.default(moved, -2)
    pairs = aten.expand.default(rows, list(moved.shape[:-1]) + [length, length])
    ones = aten.ones.default([length, length], dtype=torch.bool, device=x.device)
    later = aten.logical_not.default(aten.tril.default(ones))
    masked = aten.masked_fill.Scalar(pairs, later, -math.inf)
    return aten.movedim.int(aten.logsumexp.default(masked, [-1]), -1, dim)


def infinity_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """linalg_vector_norm with ord inf / -inf of a non-empty floating tensor as amax / amin
    of abs, which lort makes NaN-propagating: torch_lib's ReduceMax/ReduceMin of Abs gave
    5 (inf) and 0 (-inf) for [0, 5, nan, 1], PyTorch NaN. Other orders are left to the op."""
    if ord not in (math.inf, -math.inf) or not x.dtype.is_floating_point or x.numel() == 0:
        return NotImplemented
    if dtype is not None and dtype != x.dtype:
        x = aten._to_copy.default(x, dtype=dtype)
    dims = [] if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    reduce = aten.amax.default if ord > 0 else aten.amin.default
    return reduce(aten.abs.default(x), dims, keepdim)


def accurate_log1p(x):
    """log1p of a floating tensor as x * (log(u) / (u - 1)) with u = 1 + x (Goldberg's
    correction; the ratio is 1 where u rounds to 1 or is inf, so -0.0 stays -0.0):
    torch_lib's log(1 + x) loses every digit for |x| below the dtype's epsilon (float32
    log1p(1e-30) gave 0, so xlog1py(3e38, 1e-30) gave 0, PyTorch 3e8)."""
    if not x.dtype.is_floating_point:
        return NotImplemented
    u = aten.add.Scalar(x, 1)
    ratio = aten.div.Tensor(aten.log.default(u), aten.sub.Scalar(u, 1))
    exact = aten.logical_or.default(aten.eq.Scalar(u, 1), aten.eq.Scalar(u, math.inf))
    return aten.mul.Tensor(x, aten.masked_fill.Scalar(ratio, exact, 1.0))
