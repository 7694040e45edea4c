"""Exponential-based functions accurate at small values, where ORT's kernels or
torch_lib's translations are not (registered by ``decompositions.table``):

* ``expm1``: torch_lib writes ``exp(x) - 1``, which loses every digit below the dtype's
  epsilon (float32 expm1(1e-10) was 0, expm1(1e-5) off by 0.14%). Kahan's form
  ``(u - 1) * x / log(u)`` with ``u = exp(x)`` is accurate to a few ulp.
* ``elu``, ``celu``, ``selu``: ORT's Elu, Celu and Selu compute ``exp(x) - 1`` (elu(-1e-10)
  was 0 in float32); PyTorch's decompositions over the accurate ``expm1``, as eager's
  kernel does.
* ``sigmoid``, ``silu``, ``glu`` and their backward: MLAS's logistic (ORT's CPU Sigmoid) is
  accurate in absolute terms only (float32 sigmoid(-17.26) was 3.7 times eager's value,
  0 below -30; float64 sigmoid(-100) was 0), and ORT's CUDA Sigmoid computes
  ``1 - 1 / (1 + exp(x))`` for x <= 0, 0 below about -17 in float32. Eager's formula,
  ``1 / (1 + exp(-x))``, on every device.
* ``softplus`` except ORT's CPU kernel, which is accurate (float64 has none and was 0 for
  softplus(-100); ORT's CUDA Softplus computes ``log(exp(x) + 1)``): ``log1p(exp(x))``,
  eager's formula; ``mish`` there likewise, whose translation has its own softplus.
"""

from __future__ import annotations

import math

import torch
from torch._decomp import decomposition_table

from ..fusion import support

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
    """PyTorch's decomposition of silu_backward, over the sigmoid above."""
    s = sigmoid(x)
    return aten.mul.Tensor(aten.mul.Tensor(grad, s), aten.add.Scalar(aten.mul.Tensor(x, aten.rsub.Scalar(s, 1)), 1))


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
        aten.elu.default: _pytorch(aten.elu.default),
        aten.celu.default: _pytorch(aten.celu.default),
        aten.selu.default: _pytorch(aten.selu.default),
        aten.sigmoid.default: sigmoid,
        aten.silu.default: silu,
        aten.silu_backward.default: silu_backward,
        aten.softplus.default: _where_softplus_kernel_is_not(aten.softplus.default),
        aten.glu.default: _pytorch(aten.glu.default),
        aten.glu_backward.default: _pytorch(aten.glu_backward.default),
        aten.mish.default: _where_softplus_kernel_is_not(aten.mish.default),
        aten.mish_backward.default: _where_softplus_kernel_is_not(aten.mish_backward.default),
    }
