"""Ops on dtypes ORT has no kernel for, written over kernels it has (registered by
``decompositions.table``). Each applies only where ORT's provider for the input's device
lacks the kernel (``support.ort_has_kernel``), so float32 and CUDA graphs keep the one
ONNX operator:

* unary float ops of integer or bool inputs (acos, erf, sinh, ...: ORT's kernels are
  float only): the input cast to eager's float dtype first, as eager's type promotion
  does. ``isnan`` of an integer or bool tensor is all False.
* ``addmm`` without a Gemm kernel (int64): a matrix product (MatMul has integer kernels)
  and the additions.
* ``convolution`` without a Conv kernel (float64, int64 on CPU): the input's patches,
  one strided slice per kernel offset, times the weight in one batched matrix product
  per group. A transposed convolution: each kernel offset's products, spread by the
  stride and placed where the offset puts them, summed (eager's col2im).
* ``avg_pool2d`` / ``avg_pool3d`` without an AveragePool kernel (float64, int64) or with
  a ``divisor_override`` (which torch_lib ignores): the sum of the strided slices of the
  zero-padded input, divided by each window's count as PyTorch's kernel counts it
  (``count_include_pad``, ``ceil_mode``); integers divide rounding toward zero, as C's
  ``/`` in eager's kernel does.
"""

from __future__ import annotations

import itertools
import math

import torch

from ...fusion import support
from .rounding import truncated_division

aten = torch.ops.aten

#: Unary ops whose ORT kernels are float only and whose integer inputs eager promotes to
#: its default float dtype.
FLOAT_ONLY_UNARY = (
    aten.acos.default, aten.acosh.default, aten.asin.default, aten.asinh.default, aten.atan.default,
    aten.atanh.default, aten.cosh.default, aten.sinh.default, aten.tan.default, aten.erf.default,
)


def _integral(x) -> bool:
    return isinstance(x, torch.Tensor) and not x.dtype.is_floating_point and not x.dtype.is_complex


def _float_first(op):
    def decomposition(x):
        if not _integral(x):
            return NotImplemented
        return op(aten._to_copy.default(x, dtype=torch.get_default_dtype()))

    decomposition.__name__ = f"{op.__name__.split('.')[0]}_of_integers"
    return decomposition


def integer_isnan(x):
    """isnan of an integer or bool tensor: False everywhere (``x != x``)."""
    if not _integral(x):
        return NotImplemented
    return aten.ne.Tensor(x, x)


def _has(op_type: str, x) -> bool:
    return support.ort_has_kernel(op_type, x.dtype, x.device)


def addmm_without_gemm(bias, mat1, mat2, *, beta=1, alpha=1):
    """``beta * bias + alpha * (mat1 @ mat2)`` as a matrix product and additions, where
    ORT has no Gemm kernel for the dtype (int64); beta 0 ignores ``bias`` (eager's rule)."""
    if _has("Gemm", mat1) or not _has("MatMul", mat1):
        return NotImplemented
    product = aten.mm.default(mat1, mat2)
    if alpha != 1:
        product = aten.mul.Tensor(product, alpha)
    if beta == 0:
        return product
    scaled = bias if beta == 1 else aten.mul.Tensor(bias, beta)
    return aten.add.Tensor(scaled, product)


def _pad_spatial(x, nd: int, before: list[int], after: list[int]):
    """Zero padding (negative: cropping) of the last ``nd`` dims."""
    pads = []
    for b, a in zip(reversed(before), reversed(after)):
        pads += [b, a]
    if not any(pads):
        return x
    return aten.constant_pad_nd.default(x, pads, 0)


def _patches(x, nd: int, kernel: list[int], stride: list[int], dilation: list[int], out: list[int],
             stacked: bool = True):
    """(N, C, prod(kernel), *out): for each kernel offset, the strided slice of ``x``
    (already padded) that the offset meets across the output positions (the list of
    slices where not ``stacked``)."""
    slices = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        s = x
        for i in range(nd):
            start = offset[i] * dilation[i]
            s = aten.slice.Tensor(s, 2 + i, start, start + stride[i] * (out[i] - 1) + 1, stride[i])
        slices.append(s)
    return aten.stack.default(slices, 2) if stacked else slices


def _conv(x, weight, bias, stride, padding, dilation, groups):
    nd = x.dim() - 2
    n, c = x.shape[0], x.shape[1]
    o, kernel = weight.shape[0], list(weight.shape[2:])
    x = _pad_spatial(x, nd, list(padding), list(padding))
    out = [(x.shape[2 + i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1 for i in range(nd)]
    positions, taps = math.prod(out), math.prod(kernel)
    patches = _patches(x, nd, kernel, stride, dilation, out)  # (N, C, K, *out)
    patches = aten.view.default(patches, [n, groups, (c // groups) * taps, positions])
    patches = aten.permute.default(patches, [1, 2, 0, 3])
    patches = aten.reshape.default(patches, [groups, (c // groups) * taps, n * positions])
    w = aten.reshape.default(weight, [groups, o // groups, (c // groups) * taps])
    y = aten.bmm.default(w, patches)  # (G, O/G, N * P)
    y = aten.permute.default(aten.view.default(y, [groups, o // groups, n, positions]), [2, 0, 1, 3])
    y = aten.reshape.default(y, [n, o, *out])
    if bias is not None:
        y = aten.add.Tensor(y, aten.view.default(bias, [o] + [1] * nd))
    return y


def _spread(x, first: int, stride: list[int]):
    """``x`` with ``stride - 1`` zeros between neighbours along each spatial dim (the dims
    from ``first`` on)."""
    for i, s in enumerate(stride):
        if s == 1:
            continue
        dim = first + i
        length = x.shape[dim]
        zeros_shape = list(x.shape)
        zeros_shape.insert(dim + 1, s - 1)
        zeros = aten.zeros.default(zeros_shape, dtype=x.dtype, device=x.device)
        x = aten.cat.default([aten.unsqueeze.default(x, dim + 1), zeros], dim + 1)
        shape = list(x.shape[:dim]) + [length * s] + list(x.shape[dim + 2:])
        x = aten.slice.Tensor(aten.reshape.default(x, shape), dim, 0, (length - 1) * s + 1)
    return x


def _conv_transposed(x, weight, bias, stride, padding, dilation, output_padding, groups):
    """Each kernel offset's products (one batched matrix product for all of them), spread
    by the stride and placed at the offset, summed: eager's col2im adds the same
    products, so no inserted zero is ever multiplied (0 * inf would be NaN)."""
    nd = x.dim() - 2
    n, c_in, lengths = x.shape[0], x.shape[1], list(x.shape[2:])
    c_out_g, kernel = weight.shape[1], list(weight.shape[2:])
    c_out, taps, positions = c_out_g * groups, math.prod(kernel), math.prod(lengths)
    out = [(lengths[i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (kernel[i] - 1) + output_padding[i] + 1
           for i in range(nd)]
    w = aten.reshape.default(weight, [groups, c_in // groups, c_out_g * taps])
    xs = aten.view.default(x, [n, groups, c_in // groups, positions])
    xs = aten.reshape.default(aten.permute.default(xs, [1, 2, 0, 3]), [groups, c_in // groups, n * positions])
    cols = aten.bmm.default(aten.transpose.int(w, 1, 2), xs)  # (G, Cout/G * K, N * P)
    cols = aten.view.default(cols, [groups, c_out_g, taps, n, *lengths])
    cols = aten.reshape.default(aten.permute.default(cols, [2, 3, 0, 1, *range(4, 4 + nd)]), [taps, n, c_out, *lengths])
    cols = _spread(cols, 3, list(stride))
    placed = []
    for j, offset in enumerate(itertools.product(*(range(k) for k in kernel))):
        part = aten.select.int(cols, 0, j)
        before = [offset[i] * dilation[i] - padding[i] for i in range(nd)]
        after = [out[i] - before[i] - part.shape[2 + i] for i in range(nd)]
        placed.append(_pad_spatial(part, nd, before, after))
    y = aten.sum.dim_IntList(aten.stack.default(placed, 0), [0]) if len(placed) > 1 else placed[0]
    if bias is not None:
        y = aten.add.Tensor(y, aten.view.default(bias, [c_out] + [1] * nd))
    return y


def convolution_without_conv(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """aten.convolution where ORT has no Conv kernel for the dtype (float64, int64 on CPU)
    and has a MatMul one."""
    if _has("Conv", x) or not _has("MatMul", x) or x.dim() < 3 or x.dim() != weight.dim():
        return NotImplemented
    if transposed:
        return _conv_transposed(x, weight, bias, stride, padding, dilation, output_padding, groups)
    return _conv(x, weight, bias, list(stride), list(padding), list(dilation), groups)


def _pooled_length(length: int, k: int, s: int, p: int, ceil_mode: bool) -> int:
    """PyTorch's pooling_output_shape (dilation 1)."""
    out = (length + 2 * p - (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= length + p:
        out -= 1
    return out


def _window_counts(lengths, kernel, stride, padding, out, include_pad: bool, like):
    """Each output's divisor: its window's size clipped to the padded input
    (``include_pad``) or to the input, per dim, multiplied over the dims."""
    total = None
    nd = len(lengths)
    for i in range(nd):
        start = aten.sub.Tensor(
            aten.mul.Tensor(aten.arange.start_step(0, out[i], 1, dtype=torch.int64, device=like.device), stride[i]),
            padding[i])
        end = aten.clamp_max.default(aten.add.Tensor(start, kernel[i]), lengths[i] + padding[i])
        if not include_pad:
            start = aten.clamp_min.default(start, 0)
            end = aten.clamp_max.default(end, lengths[i])
        size = aten.view.default(aten.sub.Tensor(end, start), [out[i] if j == i else 1 for j in range(nd)])
        total = size if total is None else aten.mul.Tensor(total, size)
    return aten._to_copy.default(total, dtype=like.dtype)


def _avg_pool(nd: int):
    def avg_pool(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                 divisor_override=None):
        if (_has("AveragePool", x) and not divisor_override) or x.dim() not in (nd + 1, nd + 2):
            return NotImplemented
        if x.dtype.is_complex or x.dtype == torch.bool:
            return NotImplemented

        def per_dim(v, default=None):
            v = default if v is None or (isinstance(v, (list, tuple)) and not v) else v
            return list(v) * (nd // len(v)) if isinstance(v, (list, tuple)) else [v] * nd

        kernel, pad = per_dim(kernel_size), per_dim(padding)
        step = per_dim(stride, kernel)
        batched = x if x.dim() == nd + 2 else aten.unsqueeze.default(x, 0)
        lengths = list(batched.shape[2:])
        out = [_pooled_length(lengths[i], kernel[i], step[i], pad[i], ceil_mode) for i in range(nd)]
        after = [max((out[i] - 1) * step[i] + kernel[i] - lengths[i] - pad[i], 0) for i in range(nd)]
        padded = _pad_spatial(batched, nd, pad, after)
        # Added one slice after another, in the window's row-major order: eager's loop,
        # so overflow-scale values cancel and absorb in the same order.
        slices = _patches(padded, nd, kernel, step, [1] * nd, out, stacked=False)
        sums = slices[0]
        for part in slices[1:]:
            sums = aten.add.Tensor(sums, part)
        if divisor_override:
            divisor = aten.scalar_tensor.default(divisor_override, dtype=sums.dtype, device=x.device)
        else:
            divisor = _window_counts(lengths, kernel, step, pad, out, count_include_pad, sums)
        y = aten.div.Tensor(sums, divisor) if x.dtype.is_floating_point else truncated_division(sums, divisor)
        return y if x.dim() == nd + 2 else aten.squeeze.dim(y, 0)

    avg_pool.__name__ = f"avg_pool{nd}d_without_average_pool"
    return avg_pool


def table() -> dict:
    out = {op: _float_first(op) for op in FLOAT_ONLY_UNARY}
    out[aten.isnan.default] = integer_isnan
    out[aten.addmm.default] = addmm_without_gemm
    out[aten.convolution.default] = convolution_without_conv
    out[aten.avg_pool2d.default] = _avg_pool(2)
    out[aten.avg_pool3d.default] = _avg_pool(3)
    return out
