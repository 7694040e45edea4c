"""The decomposition table lort traces with.

Start from PyTorch's own decompositions of exactly the ops torch_lib cannot translate
(``_compat.decomposition_table``, given the support checker's
``implemented_overload_names``), then add the ones that keep backward graphs in ORT:

* attention is traced in its math form (``capture.aot`` selects PyTorch's math SDPA
  backend while tracing), because the fused CPU kernel's backward has no ONNX
  translation while the math form's backward is matmuls and softmax.
* ``convolution_backward`` (no PyTorch decomposition, no torch_lib translation) can be
  written as the convolutions that compute it, below. It is off by default
  (``Options.decompose_conv_backward``): ORT's Conv with a kernel as large as the
  feature map is slow (benchmarks/conv_backward.md).
* ``_transformer_encoder_layer_fwd``, nn.TransformerEncoderLayer's inference fast path
  (no torch_lib translation), is written as the attention, feed-forward and layer
  norms it computes; with an attention mask it stays whole (runs in PyTorch).
* ``embedding_dense_backward`` is kept whole and runs in PyTorch's kernel (no torch_lib
  translation). PyTorch's decomposition is a scatter-add into zeros of the embedding
  table's size, which ORT's constant folding turned into an initializer every backward
  session held for good (BERT-base: 89 MiB; a 32k x 4096 vocabulary: 500 MiB).
* ``native_batch_norm_backward`` in training (batch statistics) is kept whole and runs in
  PyTorch's fused kernel (no torch_lib translation). Its decomposition, a dozen elementwise
  ops and reductions per layer, ran 9x eager's kernel in ORT (ResNet-50's backward on an
  Intel Xeon: 405 + 24 ms against 48 ms, benchmarks/backward_breakdown.md); kept whole, a ResNet-50 training
  step with every group in ORT is 1.11x faster (3014 against 3333 ms, batch 8 at 224 px).
  Layer norm's, softmax's and GELU's backward stay decomposed: kept whole, BERT-base's
  step (batch 4 x 128) was 0.99x / 1.00x / 1.00x as fast, so no gain pays for the
  boundary between ORT groups (benchmarks/engines.md, ``fused_backward.py``).
* integer ``div(..., rounding_mode="floor")`` becomes ``floor_divide``.
* NaN semantics: amax/amin/max/min, argmax/argmin, max_pool and sign get an isnan-based
  select after the op, so ORT's results follow PyTorch's on inputs with NaN (below).
* single ops whose translation fails on some inputs (reductions of 0-d tensors, ...):
  ``decompositions_ops``.
* indexing ops torch_lib has no translation for (searchsorted, diagonal_scatter,
  index_reduce, cummax/cummin): ``decompositions_indexing``.
* lgamma, digamma and polygamma (no ONNX op) as PyTorch's CPU algorithms in elementwise
  ops: ``decompositions_special``; Bessel j0, j1, y0, y1 and spherical j0:
  ``decompositions_bessel``; modified Bessel i0, i1, k0, k1, scaled k0, k1 and Airy Ai:
  ``decompositions_bessel_modified``.
* linalg_solve_triangular and triangular_solve as substitution steps, lu_unpack as masks
  and row swaps: ``decompositions_linalg``.
* ops on dtypes ORT has no kernel for (integer inputs of float-only unary ops, int64
  addmm, float64 and int64 convolution, float64 average pooling): ``decompositions_kernels``.
* float floor division and remainder from fmod, integer truncating division, fmax/fmin:
  ``decompositions_rounding``; erf (float64), erfc, erfcx, ndtri, erfinv and log_ndtr:
  ``decompositions_erf``; expm1, elu/celu/selu, sigmoid/silu/glu, softplus and mish
  where ORT's kernel is not accurate at small values: ``decompositions_exponential``.
"""

from __future__ import annotations

import functools
import math
import threading

import torch

from ..fusion import support
from ..translate import _compat
from . import (
    decompositions_bessel,
    decompositions_bessel_modified,
    decompositions_erf,
    decompositions_exponential,
    decompositions_indexing,
    decompositions_kernels,
    decompositions_linalg,
    decompositions_ops,
    decompositions_rounding,
    decompositions_special,
)

aten = torch.ops.aten


def _conv_input_grad(grad_out, weight, input_shape, stride, padding, dilation, groups):
    nd = len(stride)
    output_padding = []
    for i in range(nd):
        k = weight.shape[2 + i]
        full = (grad_out.shape[2 + i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (k - 1) + 1
        output_padding.append(input_shape[2 + i] - full)
    return aten.convolution.default(
        grad_out, weight, None, list(stride), list(padding), list(dilation), True, output_padding, groups
    )


def _conv_weight_grad(grad_out, inp, weight_shape, stride, padding, dilation, groups):
    nd = len(stride)
    n, c_in = inp.shape[0], inp.shape[1]
    c_out = grad_out.shape[1]
    spatial_in = list(inp.shape[2:])
    spatial_out = list(grad_out.shape[2:])
    # Batch becomes channels: x (N, G*Cg, *S) -> (Cg, G*N, *S); dy (N, G*Og, *So) -> (G*Og, N, *So).
    x = inp.reshape([n, groups, c_in // groups] + spatial_in)
    x = x.permute([2, 1, 0] + list(range(3, 3 + nd))).reshape([c_in // groups, groups * n] + spatial_in)
    dy = grad_out.reshape([n, groups, c_out // groups] + spatial_out)
    dy = dy.permute([1, 2, 0] + list(range(3, 3 + nd))).reshape([c_out, n] + spatial_out)
    gw = aten.convolution.default(
        x, dy, None, list(dilation), list(padding), list(stride), False, [0] * nd, groups
    )  # (Cg, Cout, *K') with K' >= K
    for i in range(nd):
        gw = gw.narrow(2 + i, 0, weight_shape[2 + i])
    return gw.transpose(0, 1).contiguous()


def convolution_backward(
    grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    """aten.convolution_backward as convolutions, for non-transposed convolutions."""
    if transposed:
        return NotImplemented
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        grad_input = _conv_input_grad(grad_output, weight, input.shape, stride, padding, dilation, groups)
    if output_mask[1]:
        grad_weight = _conv_weight_grad(grad_output, input, weight.shape, stride, padding, dilation, groups)
    if output_mask[2]:
        grad_bias = grad_output.sum([0] + list(range(2, grad_output.dim())))
    return grad_input, grad_weight, grad_bias


def transformer_encoder_layer_fwd(
    src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu, norm_first, eps,
    norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2,
    mask=None, mask_type=None,
):
    """nn.TransformerEncoderLayer's inference fast path (batch first) as plain ops."""
    if mask is not None:
        return NotImplemented
    F = torch.nn.functional
    b, n, e = src.shape
    d = e // num_heads

    def attention(x):
        q, k, v = F.linear(x, qkv_weight, qkv_bias).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, num_heads, d).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / d**0.5)
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e)
        return F.linear(out, proj_weight, proj_bias)

    def feed_forward(x):
        h = F.linear(x, ffn_weight_1, ffn_bias_1)
        h = F.gelu(h) if use_gelu else F.relu(h)
        return F.linear(h, ffn_weight_2, ffn_bias_2)

    def norm(x, w, bias):
        return F.layer_norm(x, (e,), w, bias, eps)

    if norm_first:
        x = src + attention(norm(src, norm_weight_1, norm_bias_1))
        return x + feed_forward(norm(x, norm_weight_2, norm_bias_2))
    x = norm(src + attention(src), norm_weight_1, norm_bias_1)
    return norm(x + feed_forward(x), norm_weight_2, norm_bias_2)


def div_floor_integer(a, b, *, rounding_mode=None):
    """Integer ``div(a, b, rounding_mode="floor")`` as ``floor_divide``, whose torch_lib
    translation is exact (div with rounding_mode divides in float32 and stays in
    PyTorch, splitting graphs that do index arithmetic)."""
    b_float = b.dtype.is_floating_point if isinstance(b, torch.Tensor) else isinstance(b, float)
    if rounding_mode != "floor" or a.dtype.is_floating_point or b_float:
        return NotImplemented
    if not isinstance(b, torch.Tensor):
        b = aten.scalar_tensor.default(b, dtype=a.dtype, device=a.device)
    return aten.floor_divide.default(a, b)


# -- NaN semantics ------------------------------------------------------------------
# ORT's ReduceMax/ReduceMin, ArgMax/ArgMin and MaxPool skip NaN (NaN compares false) and
# its Sign returns NaN for NaN, where PyTorch's amax/amin/max/min and max_pool propagate
# NaN, argmax/argmin/max.dim point at the first NaN, max_pool's indices at the last NaN
# of the window, and sign(NaN) is 0. Each decomposition below keeps the op whole and
# fixes its result where the input has a NaN (an isnan-based select). The op itself is
# called inside its own decomposition: ``_nan_fix`` makes that inner call trace as is.
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


def copysign(a, b):
    """copysign as ``where(signbit(b), -|a|, |a|)`` with aten.signbit. PyTorch's own
    decomposition uses prims.signbit, whose fake tensor is float32 where the real one is
    bool, so the ORT group it feeds was built for a float input and failed at run time."""
    dtype = torch.result_type(a, b)
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    magnitude = torch.abs(a.to(dtype))
    if not isinstance(b, torch.Tensor):
        return torch.neg(magnitude) if math.copysign(1.0, b) < 0 else magnitude
    return torch.where(torch.signbit(b), torch.neg(magnitude), magnitude)


#: Ops PyTorch decomposes that lort keeps whole, to run in PyTorch's fused kernel (the
#: module's docstring says why each).
KEPT_WHOLE = (aten.embedding_dense_backward.default,)


def _batch_norm_backward_in_training(decomposition):
    """native_batch_norm_backward kept whole where it normalized by the batch's statistics
    (``train``): PyTorch's fused kernel. In eval mode its decomposition is a scale and a
    sum that ORT runs with its neighbours, and the whole op would need the forward's saved
    statistics, which the inference forward gives as empty tensors (ORT cannot)."""

    def decompose(grad_out, inp, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                  output_mask):
        if train:
            return NotImplemented  # the tracer keeps the op
        return decomposition(grad_out, inp, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                             output_mask)

    return decompose


@functools.lru_cache(maxsize=4)
def table(decompose_conv_backward: bool = False, implemented: tuple[str, ...] | None = None) -> dict:
    """The decomposition table AOTAutograd traces with: PyTorch's decompositions of the
    ops torch_lib does not translate correctly (``implemented`` names those it does; the
    support checker's ``implemented_overload_names()`` when None), plus lort's."""
    if implemented is None:
        implemented = support.implemented_overload_names()
    decomps = dict(_compat.decomposition_table(implemented))
    # Decompositions that break tracing: lift_fresh's turns a torch.tensor() constant
    # into an alias of a real tensor inside FakeTensorMode; diagonal_scatter's and
    # as_strided_scatter's (torch._refs) emit prims.copy_to, which AOTAutograd rejects as
    # not functional. Without them the ops stay whole (diagonal_scatter then gets lort's
    # own, decompositions_indexing's).
    for op in (aten.lift_fresh.default, aten.diagonal_scatter.default, aten.as_strided_scatter.default):
        decomps.pop(op, None)
    # An embedding's and a batch norm's backward stay whole, in PyTorch (the module's docstring).
    for op in KEPT_WHOLE:
        decomps.pop(op, None)
    bn_backward = aten.native_batch_norm_backward.default
    if bn_backward in decomps:
        decomps[bn_backward] = _batch_norm_backward_in_training(decomps[bn_backward])
    if decompose_conv_backward:
        decomps[aten.convolution_backward.default] = convolution_backward
    decomps[aten._transformer_encoder_layer_fwd.default] = transformer_encoder_layer_fwd
    decomps[aten.div.Tensor_mode] = div_floor_integer
    decomps[aten.div.Scalar_mode] = div_floor_integer
    decomps.update(nan_decompositions())
    decomps[aten.copysign.Tensor] = copysign
    decomps[aten.copysign.Scalar] = copysign
    decomps.update(decompositions_ops.table(decomps))
    decomps.update(decompositions_indexing.table())
    decomps.update(decompositions_special.table())
    decomps.update(decompositions_bessel.table())
    decomps.update(decompositions_bessel_modified.table())
    decomps.update(decompositions_linalg.table())
    for op, fn in {**decompositions_kernels.table(), **decompositions_rounding.table()}.items():
        decomps[op] = decompositions_ops.chain(fn, decomps.get(op))
    for op, fn in {**decompositions_erf.table(), **decompositions_exponential.table()}.items():
        decomps[op] = decompositions_ops.chain(fn, decomps.get(op))
    return decomps
