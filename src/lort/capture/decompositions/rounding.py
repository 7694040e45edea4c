"""Floor division, remainder and truncating integer division as PyTorch computes them
(registered by ``decompositions.table``), where torch_lib's translations differ
(``fusion/known_wrong.py``):

* float ``floor_divide``, ``div(rounding_mode="floor")`` and ``remainder``: PyTorch
  works from ``fmod``, which is exact (c10/util/generic_math.h, ``div_floor_floating``;
  ATen's remainder kernel), where torch_lib computes ``floor(a / b)`` and
  ``a - floor(a / b) * b``, which differ when ``a / b`` rounds to an integer
  (7.0 // 0.1 is 69 in PyTorch, 70 from ``floor(a / b)``). ONNX's Mod with ``fmod=1``
  is C's fmod, so the same steps run in ORT.
* integer ``div(rounding_mode="trunc")``: floor division (exact in torch_lib) plus one
  where the quotient is negative and inexact. A zero divisor raises in ORT, and the
  group then runs in PyTorch, which raises its own ZeroDivisionError.
* ``fmax`` / ``fmin``: the larger / smaller value, NaN only where both are NaN, the
  first operand on a tie (the sign of a zero).
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def _operands(a, b):
    """``a`` and ``b`` as tensors of their result dtype, or None where it is not float."""
    dtype = torch.result_type(a, b)
    if not dtype.is_floating_point or dtype not in (torch.float32, torch.float64, torch.float16):
        return None
    like = a if isinstance(a, torch.Tensor) else b

    def tensor(v):
        if isinstance(v, torch.Tensor):
            return v if v.dtype == dtype else aten._to_copy.default(v, dtype=dtype)
        return aten.scalar_tensor.default(v, dtype=dtype, device=like.device)

    return tensor(a), tensor(b)


def _wrong_sign(mod, b):
    """Where fmod's result is nonzero and its sign is not the divisor's."""
    return aten.logical_and.default(aten.ne.Scalar(mod, 0), aten.ne.Tensor(aten.lt.Scalar(b, 0), aten.lt.Scalar(mod, 0)))


def _floor_division(a, b):
    """div_floor_floating: the exact quotient of ``a - fmod(a, b)`` by ``b``, one less where
    fmod's sign is not ``b``'s, rounded to the nearest integer at or below; a zero
    quotient takes the sign of ``a / b``; a zero divisor gives ``a / b``."""
    quotient = aten.div.Tensor(a, b)
    mod = aten.fmod.Tensor(a, b)
    div = aten.div.Tensor(aten.sub.Tensor(a, mod), b)
    div = aten.sub.Tensor(div, aten._to_copy.default(_wrong_sign(mod, b), dtype=div.dtype))
    floor = aten.floor.default(div)
    floor = aten.add.Tensor(floor, aten._to_copy.default(aten.gt.Scalar(aten.sub.Tensor(div, floor), 0.5),
                                                         dtype=div.dtype))
    signed_zero = aten.mul.Tensor(quotient, 0)  # finite wherever div is 0; NaN where div is
    # ORT's Where gives +0.0 where it selects a -0.0 of its first value input: the signed
    # zero goes second, under a single-op condition (ORT fuses Not into Where by swapping).
    out = aten.where.self(aten.gt.Scalar(aten.abs.default(div), 0), floor, signed_zero)
    return aten.where.self(aten.eq.Scalar(b, 0), quotient, out)


def floor_divide(a, b):
    operands = _operands(a, b)
    return NotImplemented if operands is None else _floor_division(*operands)


def div_rounding(a, b, *, rounding_mode=None):
    """div with rounding_mode: float "floor" as PyTorch's floor division; integer "trunc"
    as floor division plus one where the quotient is negative and inexact."""
    if rounding_mode == "floor":
        return floor_divide(a, b)
    if rounding_mode != "trunc" or torch.result_type(a, b).is_floating_point:
        return NotImplemented
    dtype = torch.result_type(a, b)
    if not isinstance(a, torch.Tensor):
        a = aten.scalar_tensor.default(a, dtype=dtype, device=b.device)
    if not isinstance(b, torch.Tensor):
        b = aten.scalar_tensor.default(b, dtype=dtype, device=a.device)
    if dtype == torch.bool or a.dtype != dtype or b.dtype != dtype:
        return NotImplemented
    return truncated_division(a, b)


def truncated_division(a, b):
    """Integer ``a / b`` rounded toward zero (C's ``/``): floor division (exact in
    torch_lib) plus one where the quotient is negative and inexact."""
    floor = aten.floor_divide.default(a, b)
    inexact = aten.ne.Tensor(aten.mul.Tensor(floor, b), a)
    negative = aten.ne.Tensor(aten.lt.Scalar(a, 0), aten.lt.Scalar(b, 0))
    return aten.add.Tensor(floor, aten._to_copy.default(aten.logical_and.default(inexact, negative), dtype=a.dtype))


def remainder(a, b):
    """PyTorch's float remainder: fmod, plus ``b`` where fmod's sign is not ``b``'s."""
    operands = _operands(a, b)
    if operands is None:
        return NotImplemented
    a, b = operands
    mod = aten.fmod.Tensor(a, b)
    return aten.where.self(_wrong_sign(mod, b), aten.add.Tensor(mod, b), mod)


def _nan_ignoring(op, identity: float):
    """``op`` ignoring a NaN operand, and ``a`` where the two compare equal (eager's
    ``fmax(0.0, -0.0)`` is 0.0 and ``fmax(-0.0, 0.0)`` is -0.0).

    ORT's Max and Min give their second operand on a tie, so the operands go in swapped.
    A NaN operand becomes ``identity`` (-inf for fmax) before the op rather than being
    replaced by the other value after it: ORT's Where gives +0.0 where it selects a -0.0
    from its first value input, and only constants nonzero go there."""

    def decomposition(a, b):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or torch.result_type(a, b).is_complex:
            return NotImplemented
        dtype = torch.result_type(a, b)
        a, b = (t if t.dtype == dtype else aten._to_copy.default(t, dtype=dtype) for t in (a, b))
        if not dtype.is_floating_point:
            return op(a, b)
        a_nan, b_nan = aten.isnan.default(a), aten.isnan.default(b)
        fill = aten.scalar_tensor.default(identity, dtype=dtype, device=a.device)
        nan = aten.scalar_tensor.default(math.nan, dtype=dtype, device=a.device)
        out = op(aten.where.self(b_nan, fill, b), aten.where.self(a_nan, fill, a))
        return aten.where.self(aten.logical_and.default(a_nan, b_nan), nan, out)

    decomposition.__name__ = "f" + op.__name__.split(".")[0][:3]
    return decomposition


fmax = _nan_ignoring(aten.maximum.default, -math.inf)
fmin = _nan_ignoring(aten.minimum.default, math.inf)


def table() -> dict:
    return {
        aten.floor_divide.default: floor_divide,
        aten.floor_divide.Scalar: floor_divide,
        aten.div.Tensor_mode: div_rounding,
        aten.div.Scalar_mode: div_rounding,
        aten.remainder.Tensor: remainder,
        aten.remainder.Scalar: remainder,
        aten.remainder.Scalar_Tensor: remainder,
        aten.fmax.default: fmax,
        aten.fmin.default: fmin,
    }
