"""NaN semantics: decompositions that give ORT's graphs PyTorch's results on inputs with
NaN.

ORT's ReduceMax/ReduceMin, ArgMax/ArgMin and MaxPool skip NaN (NaN compares false) and
its Sign returns NaN for NaN, where PyTorch's amax/amin/max/min and max_pool propagate
NaN, argmax/argmin/max.dim point at the first NaN, max_pool's indices at the last NaN of
the window, and sign(NaN) is 0. Each decomposition here keeps the op whole and fixes its
result where the input has a NaN (an isnan-based select). The op itself is called inside
its own decomposition: ``_nan_fix`` makes that inner call trace as is.
"""

from __future__ import annotations

import functools
import math
import threading

import torch

aten = torch.ops.aten

_NAN_FIX_ACTIVE = threading.local()


def _nan_fix(op):
    """A decomposition of ``op`` that calls ``op``: the inner call is not decomposed again."""

    def wrap(fn):
        @functools.wraps(fn)
        def decomposition(*args, **kwargs):
            active = getattr(_NAN_FIX_ACTIVE, "ops", None)
            if active is None:
                active = _NAN_FIX_ACTIVE.ops = set()
            x = args[0]
            if op in active or not x.dtype.is_floating_point:
                return NotImplemented
            active.add(op)
            try:
                return fn(*args, **kwargs)
            finally:
                active.discard(op)

        decomposition.nan_fix_of = op
        return decomposition

    return wrap


def _any_nan(x, dim, keepdim):
    """isnan(x).any over ``dim`` (None or [] for every dimension), as amax reduces."""
    nan = aten.isnan.default(x)
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        out = aten.any.default(nan)
        if keepdim:
            out = aten.view.default(out, [1] * x.dim())
        return out
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    return aten.any.dims(nan, dims, keepdim)


def _first_nan(x, dim, keepdim):
    """The index of the first NaN along ``dim`` (argmax's convention)."""
    return aten.argmax.default(aten._to_copy.default(aten.isnan.default(x), dtype=torch.float32), dim, keepdim)


def _reduction_nan_fix(op):
    @_nan_fix(op)
    def reduce(x, dim=(), keepdim=False):
        return aten.masked_fill.Scalar(op(x, dim, keepdim), _any_nan(x, dim, keepdim), float("nan"))

    return reduce


def _full_reduction_nan_fix(op):
    @_nan_fix(op)
    def reduce(x):
        return aten.masked_fill.Scalar(op(x), aten.any.default(aten.isnan.default(x)), float("nan"))

    return reduce


def _values_indices_nan_fix(op):
    @_nan_fix(op)
    def reduce(x, dim, keepdim=False):
        values, indices = op(x, dim, keepdim)
        has_nan = _any_nan(x, dim, keepdim)
        values = aten.masked_fill.Scalar(values, has_nan, float("nan"))
        return values, aten.where.self(has_nan, _first_nan(x, dim, keepdim), indices)

    return reduce


def _arg_nan_fix(op):
    @_nan_fix(op)
    def arg(x, dim=None, keepdim=False):
        return aten.where.self(_any_nan(x, dim, keepdim), _first_nan(x, dim, keepdim), op(x, dim, keepdim))

    return arg


@_nan_fix(aten.sign.default)
def sign_nan(x):
    return aten.masked_fill.Scalar(aten.sign.default(x), aten.isnan.default(x), 0.0)


def _pair(v, default=None) -> list:
    """A 2-d pooling argument as two ints (an empty stride is the kernel's)."""
    v = default if v is None or (isinstance(v, (list, tuple)) and not v) else v
    return list(v) * (2 // len(v)) if isinstance(v, (list, tuple)) else [v, v]


def _depthwise(x, weight: float, bias: float | None, kernel=(1, 1), stride=(1, 1), padding=(0, 0), dilation=(1, 1)):
    """A depthwise convolution of ``x`` (N, C, H, W) with every weight ``weight`` and every
    bias ``bias``."""
    channels = x.shape[1]
    w = aten.full.default([channels, 1, *kernel], weight, dtype=x.dtype, device=x.device)
    b = None if bias is None else aten.full.default([channels], bias, dtype=x.dtype, device=x.device)
    return aten.convolution.default(x, w, b, list(stride), list(padding), list(dilation), False, [0, 0], channels)


def _never_negative(x) -> bool:
    """Whether ``x`` is, while tracing, the output of an op whose values are >= 0 or NaN
    (relu, or hardtanh/clamp with bounds >= 0; lort's table makes clamp_min a clamp): its
    producer is read from the tracer's proxy. False where it cannot be told."""
    from torch.fx.experimental import proxy_tensor

    mode = proxy_tensor.get_proxy_mode()
    if mode is None:
        return False
    slot = proxy_tensor.get_proxy_slot(x, mode.tracer, None)
    node = getattr(getattr(slot, "proxy", None), "node", None)
    if node is None or node.op != "call_function":
        return False
    if node.target is aten.relu.default:
        return True
    if node.target in (aten.hardtanh.default, aten.clamp.default) and len(node.args) > 1:
        low = node.args[1]
        high = node.args[2] if len(node.args) > 2 else (1.0 if node.target is aten.hardtanh.default else None)
        return _number_at_least_0(low) and (high is None or _number_at_least_0(high))
    return False


def _number_at_least_0(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


# The correction after a ReLU: w times the window's sum, for x >= 0 or NaN (a ReLU's
# output). With the pooled maximum m and k elements in the window, it is at most k * w * m
# (products and their sum rounded: (1 + 2**-23) times that at most), below half an ulp of
# any normal m for k < 2**30, so m plus it rounds to m; for a subnormal m every product
# rounds to 0; it is 0 where m is 0. It is +inf where the window has +inf (m is +inf too:
# inf + inf) and NaN where it has a NaN. w is a normal float32, so flushing subnormals
# (torch.set_flush_denormal, an ORT session's denormal-as-zero) does not make it 0, which
# would turn +inf windows into NaN (0 * inf). As one linear convolution ORT folds the add
# of it to the pooled values into the convolution (its sum input), where a Relu after it
# (relu(-sum)) kept a separate Add.
_WINDOW_WEIGHT = 2.0**-60


def _window_fix(op, nd, x, nan, kernel_size, stride, padding, dilation, ceil_mode):
    """What to add to ORT's max-pooled values to make them PyTorch's: NaN where the
    window has a NaN (ORT skips it), -inf where every element is -inf (ORT gives the
    dtype's lowest finite value, its initial maximum), +-0 elsewhere.

    In float32 inference graphs it is built of depthwise convolutions and Relu, which ORT
    keeps in its blocked (NCHWc) layout between convolutions (a select took the pooled
    values out of it and back). With M the largest float32: v = relu(x / 2 + M) is 0 only
    for -inf, at least M / 2 for any other number, NaN for NaN; s, its sum over the
    window, is 0 only where all of it is -inf; r = relu(1 - s) is 1 there, 0 elsewhere,
    NaN for NaN; -M * r added to the pooled -M overflows to -inf. Where ``x`` is a ReLU's
    output (``_never_negative``) it is one linear convolution (``_WINDOW_WEIGHT``), which
    ORT folds with the add into a single convolution whose sum input is the pooled
    values. Elsewhere (training graphs, whose weights are inputs anyway and where these
    would add gradients; other dtypes, ranks, ceil_mode): selects over the max-pooled
    masks."""
    if nd == 2 and x.dim() == 4 and not ceil_mode and x.dtype == torch.float32 and not x.requires_grad:
        big = float(torch.finfo(torch.float32).max)
        kernel = _pair(kernel_size)
        if _never_negative(x):
            return _depthwise(x, _WINDOW_WEIGHT, None, kernel, _pair(stride, kernel), _pair(padding), _pair(dilation))
        v = aten.relu.default(_depthwise(x, 0.5, big))
        s = _depthwise(v, 1.0, None, kernel, _pair(stride, kernel), _pair(padding), _pair(dilation))
        r = aten.relu.default(_depthwise(s, -1.0, 1.0))
        return _depthwise(r, -big, None)
    pool = functools.partial(op, kernel_size=kernel_size, stride=stride, padding=padding, dilation=dilation,
                             ceil_mode=ceil_mode)
    has_nan = pool(aten._to_copy.default(nan, dtype=x.dtype))[0]
    finite_or_nan = aten._to_copy.default(aten.logical_not.default(aten.isneginf.default(x)), dtype=x.dtype)
    all_neg_inf = aten.eq.Scalar(pool(finite_or_nan)[0], 0)
    fix = aten.sqrt.default(aten.neg.default(has_nan))  # NaN, or -0 (which leaves every value as it is)
    return aten.where.self(all_neg_inf, aten.scalar_tensor.default(float("-inf"), dtype=x.dtype, device=x.device), fix)


def _max_pool_nan_fix(op, nd):
    @_nan_fix(op)
    def pool(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        values, indices = op(x, kernel_size, stride, padding, dilation, ceil_mode)
        nan = aten.isnan.default(x)
        values = aten.add.Tensor(values, _window_fix(op, nd, x, nan, kernel_size, stride, padding, dilation, ceil_mode))
        spatial = list(x.shape[-nd:])
        plane = math.prod(spatial)
        pos_dtype = torch.float32 if plane <= 2**24 else torch.float64  # exact positions
        pos = aten.view.default(aten.arange.start_step(0, plane, 1, dtype=pos_dtype, device=x.device), spatial)
        # Indices (training graphs): the last NaN of each window (PyTorch's index there),
        # -1 where there is none.
        nan_pos = op(aten.where.self(nan, pos, aten.scalar_tensor.default(-1.0, dtype=pos_dtype, device=x.device)),
                     kernel_size, stride, padding, dilation, ceil_mode)[0]
        has_nan = aten.ge.Scalar(nan_pos, 0)
        indices = aten.where.self(has_nan, aten._to_copy.default(nan_pos, dtype=torch.int64), indices)
        return values, indices

    return pool


def nan_decompositions() -> dict:
    """The decompositions that give ORT's graphs PyTorch's NaN semantics."""
    out = {}
    for op in (aten.amax.default, aten.amin.default):
        out[op] = _reduction_nan_fix(op)
    for op in (aten.max.default, aten.min.default):
        out[op] = _full_reduction_nan_fix(op)
    for op in (aten.max.dim, aten.min.dim):
        out[op] = _values_indices_nan_fix(op)
    for op in (aten.argmax.default, aten.argmin.default):
        out[op] = _arg_nan_fix(op)
    out[aten.sign.default] = sign_nan
    out[aten.max_pool2d_with_indices.default] = _max_pool_nan_fix(aten.max_pool2d_with_indices.default, 2)
    out[aten.max_pool3d_with_indices.default] = _max_pool_nan_fix(aten.max_pool3d_with_indices.default, 3)
    return out
