"""Exponential-based functions where ORT's kernels or torch_lib's translations would
break lort's precision policy (README, "Precision"): results within
``torch.testing.assert_close``'s default tolerances of eager's, NaN/inf and signs as
eager's. Registered by ``decompositions.table``; each returns NotImplemented (the op is
translated as it is) where the kernel keeps the policy.

* ``expm1``: torch_lib writes ``exp(x) - 1``, which loses every digit below the dtype's
  epsilon (float32 expm1(1e-10) was 0, expm1(1e-5) off by 0.14%). Within an absolute
  tolerance, but expm1 exists for its relative accuracy near 0, and what users build on it
  (``log(expm1(x))``, ``x / expm1(x)``) turns that loss into wrong values far above any
  tolerance (log(expm1(1e-10)) was -inf, eager -23.03). Kahan's form
  ``(u - 1) * x / log(u)`` with ``u = exp(x)`` is accurate to a few ulp, on every device.
  No benchmark model calls it (the ELU family below no longer goes through it on CPU).
* ``sigmoid``, ``silu``, ``elu``, ``celu``, ``selu``: on CPU, ORT's kernels (MLAS's
  logistic; Elu, Celu, Selu) are within the tolerances in float32 and float16 from the
  smallest values to overflow, with NaN/inf and signs as eager's
  (tests/decompositions/test_decompositions_exponential.py). MLAS's logistic is accurate in absolute
  terms only (float32 sigmoid(-17.26) is 3.7 times eager's 3.2e-8): far inside atol, and
  eager's formula there cost 40% on a SiLU CNN (four nodes per SiLU where ORT fuses
  ``x * Sigmoid(x)`` into one QuickGelu, and broken NCHWc chains;
  benchmarks/studies/logistic_cost.md). float64 keeps eager's formulas (``KERNEL_DTYPES``), and
  so does elu with an input_scale, which torch_lib's translation applies to both
  branches. Elsewhere (CUDA), eager's formulas: ORT's CUDA Sigmoid computes
  ``1 - 1 / (1 + exp(x))`` for x <= 0, which in float16 is 0 below about -7.6 (eager
  5e-4, past float16's tolerance), and its Elu ``exp(x) - 1`` in the input's dtype.
  ``silu_backward`` (no torch_lib translation) is PyTorch's formula over ``sigmoid``.
* ``glu`` and its backward: ``a * sigmoid(b)`` over eager's formula on every device: with
  MLAS's logistic 0 below about -30, an infinite ``a`` became NaN.
* ``softplus`` except ORT's CPU kernel, which is accurate (float64 has none and was 0 for
  softplus(-100), and float64/float16 overflowed to inf from about 700 / 89; ORT's CUDA
  Softplus computes ``log(exp(x) + 1)``): ``log1p(exp(x))``, eager's formula; ``mish``
  there likewise, whose translation has its own softplus.
"""

from __future__ import annotations

import math

import torch
from torch._decomp import decomposition_table

from ...fusion import support

aten = torch.ops.aten


def _real_float(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype.is_floating_point


def accurate_expm1(x):
    """expm1 of a floating tensor as ``x * ((u - 1) / log(u))``, ``u = exp(x)`` (Kahan);
    the ratio is 1 where u rounds to 1 (so -0.0 stays -0.0) and inf where u is; -1 where
    ``u - 1`` is (u underflows, x = -inf)."""
    u = aten.exp.default(x)
    u_minus_1 = aten.sub.Tensor(u, 1)
    ratio = aten.div.Tensor(u_minus_1, aten.log.default(u))
    ratio = aten.masked_fill.Scalar(ratio, aten.eq.Scalar(u, 1), 1.0)
    ratio = aten.masked_fill.Scalar(ratio, aten.eq.Scalar(u, math.inf), math.inf)
    out = aten.mul.Tensor(x, ratio)
    return aten.masked_fill.Scalar(out, aten.eq.Scalar(u_minus_1, -1), -1.0)


def _floating(fn):
    """``fn`` for floating inputs; NotImplemented (the op as it is) for others. float16
    and bfloat16 tensors are computed in float32 and rounded once, as eager's kernels do
    (exp(11.5) overflows float16, where sigmoid(-11.5) does not underflow)."""

    def decomposition(x, *args, **kwargs):
        if not _real_float(x):
            return NotImplemented
        if x.dtype in (torch.float16, torch.bfloat16):
            low = x.dtype

            def up(a):
                return aten._to_copy.default(a, dtype=torch.float32) if isinstance(a, torch.Tensor) and a.dtype == low else a

            out = fn(up(x), *(up(a) for a in args), **kwargs)
            return aten._to_copy.default(out, dtype=low)
        return fn(x, *args, **kwargs)

    decomposition.__name__ = fn.__name__
    return decomposition


def _pytorch(op):
    """PyTorch's own decomposition of ``op`` (over expm1, sigmoid, softplus) for floating inputs."""
    decomposition = _floating(decomposition_table[op])
    decomposition.__name__ = f"{op.__name__.split('.')[0]}_decomposed"
    return decomposition


@_floating
def sigmoid(x):
    """``1 / (1 + exp(-x))``: eager's formula, exact to a few ulp at every x."""
    return aten.reciprocal.default(aten.add.Scalar(aten.exp.default(aten.neg.default(x)), 1))


@_floating
def silu(x):
    """``x / (1 + exp(-x))``, eager's silu kernel."""
    return aten.div.Tensor(x, aten.add.Scalar(aten.exp.default(aten.neg.default(x)), 1))


@_floating
def silu_backward(grad, x):
    """PyTorch's decomposition of silu_backward, over the sigmoid above (eager's formula
    off CPU, ORT's Sigmoid on CPU)."""
    return silu_backward_over(grad, x, sigmoid(x) if x.device.type != "cpu" else aten.sigmoid.default(x))


def silu_backward_over(grad, x, s):
    """silu_backward's formula given ``s = sigmoid(x)``: grad * s * (1 + x * (1 - s))."""
    return aten.mul.Tensor(aten.mul.Tensor(grad, s), aten.add.Scalar(aten.mul.Tensor(x, aten.rsub.Scalar(s, 1)), 1))


#: The dtypes whose ORT CPU kernels (Sigmoid, Elu, Celu, Selu) are used: float64 keeps
#: eager's formulas (accurate in relative terms, as float64 work expects; a float64
#: graph is never the fast path, and its alpha would be rounded to float32 by Elu).
KERNEL_DTYPES = (torch.float32, torch.float16)


def _off_cpu(fn, kernel_computes=None):
    """``fn``, except on CPU for KERNEL_DTYPES, where ORT's kernel is within the
    precision policy: NotImplemented there (the op is translated as it is).
    ``kernel_computes(*args)``: whether the translation computes the op at these
    arguments (torch_lib's elu applies input_scale to both branches, eager to the
    negative one only)."""

    def decomposition(x, *args, **kwargs):
        if (isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dtype in KERNEL_DTYPES
                and (kernel_computes is None or kernel_computes(*args, **kwargs))):
            return NotImplemented
        return fn(x, *args, **kwargs)

    decomposition.__name__ = fn.__name__
    return decomposition


def _input_scale_is_1(alpha=1.0, scale=1.0, input_scale=1.0) -> bool:
    return input_scale == 1


@_floating
def glu(x, dim=-1):
    """``a * sigmoid(b)`` over eager's sigmoid formula on every device: MLAS's logistic
    is 0 below about -30 (eager's float32 sigmoid only below -103.9), which makes an
    infinite ``a`` NaN where eager's is infinite."""
    a, b = aten.split.Tensor(x, x.shape[dim] // 2, dim)
    return aten.mul.Tensor(a, sigmoid(b))


@_floating
def glu_backward(grad, x, dim):
    """PyTorch's decomposition of glu_backward, over eager's sigmoid formula (as ``glu``)."""
    dim = dim % x.dim()
    first, second = aten.split.Tensor(x, x.shape[dim] // 2, dim)
    s = sigmoid(second)
    grad_second = aten.mul.Tensor(aten.mul.Tensor(aten.mul.Tensor(aten.rsub.Scalar(s, 1.0), s), first), grad)
    return aten.cat.default([aten.mul.Tensor(s, grad), grad_second], dim)


def _softplus_kernel_is_accurate(x) -> bool:
    return x.device.type == "cpu" and support.ort_has_kernel("Softplus", x.dtype, x.device)


def _where_softplus_kernel_is_not(op):
    """PyTorch's decomposition of ``op`` (softplus, ``log1p(exp(beta * x)) / beta``; mish,
    whose translation has its own softplus), except where ORT's CPU provider has its
    accurate Softplus kernel for the dtype (float32). The first argument (mish_backward's
    gradient) has the input's dtype and device."""
    reference = _pytorch(op)

    def decomposition(x, *args, **kwargs):
        if not _real_float(x) or _softplus_kernel_is_accurate(x):
            return NotImplemented
        return reference(x, *args, **kwargs)

    decomposition.__name__ = reference.__name__
    return decomposition


def table() -> dict:
    return {
        aten.expm1.default: _floating(accurate_expm1),
        aten.elu.default: _off_cpu(_pytorch(aten.elu.default), _input_scale_is_1),
        aten.celu.default: _off_cpu(_pytorch(aten.celu.default)),
        aten.selu.default: _off_cpu(_pytorch(aten.selu.default)),
        aten.sigmoid.default: _off_cpu(sigmoid),
        aten.silu.default: _off_cpu(silu),
        aten.silu_backward.default: silu_backward,
        aten.softplus.default: _where_softplus_kernel_is_not(aten.softplus.default),
        aten.glu.default: glu,
        aten.glu_backward.default: glu_backward,
        aten.mish.default: _where_softplus_kernel_is_not(aten.mish.default),
        aten.mish_backward.default: _where_softplus_kernel_is_not(aten.mish_backward.default),
    }
