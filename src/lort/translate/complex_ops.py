"""Translations lort adds for complex tensors, which ORT holds as float pairs (a trailing
dimension of 2, as torch.onnx translates them); torch_lib has no complex form of these.
They appear in the graphs of FFTs and their gradients.

``resolve_conj``: lort's group boundary (fusion/fuser.py) resolves a complex output's
conjugate bit before viewing it as float pairs, and the ONNX value already holds the
conjugated numbers (torch_lib's ``_conj`` negates the imaginary parts): the identity.
``_conj_physical`` negates the imaginary parts; ``mul.Scalar`` by a real number scales
both (the support check dispatches it; torch.onnx's type promotion then translates it as a
``mul.Tensor`` by a complex ``scalar_tensor``, translate/exact_scalars.py); ``new_zeros``, ``copy``, ``constant_pad_nd`` (zero padding only: fusion/support.py)
and ``slice_scatter`` are torch_lib's real forms with the pair dimension added (a
negative ``dim`` counted from the complex tensor's last dimension).
"""

from __future__ import annotations

import onnx_ir as ir
import torch

aten = torch.ops.aten

#: ONNX element types: the float type of each complex one's parts.
PARTS = {ir.DataType.COMPLEX64.value: ir.DataType.FLOAT.value, ir.DataType.COMPLEX128.value: ir.DataType.DOUBLE.value}


def _op():
    from onnxscript import opset18

    return opset18


def _resolve_conj(self):
    return _op().Identity(self)


def _conj_physical(self):
    op = _op()
    return op.Mul(self, op.CastLike(op.Constant(value_floats=[1.0, -1.0]), self))


def _mul_scalar(self, other):
    op = _op()
    return op.Mul(self, op.CastLike(other, self))


def _new_zeros(self, size, dtype: int = -1, layout: str = "", device: str = "", pin_memory: bool = False):
    op = _op()
    if dtype == -1 or dtype in PARTS:
        if isinstance(size, (list, tuple)) and all(isinstance(d, int) for d in size):
            shape = op.Constant(value_ints=[*size, 2])
        else:  # a shape value (dynamic sizes)
            shape = op.Concat(size, op.Constant(value_ints=[2]), axis=0)
        result = op.ConstantOfShape(shape)
        return op.CastLike(result, self) if dtype == -1 else op.Cast(result, to=PARTS[dtype])
    return op.Cast(op.ConstantOfShape(size), to=dtype)


def _copy(self, src, non_blocking: bool = False):
    return _op().CastLike(src, self)


def _constant_pad_nd(self, pad, value: float = 0.0):
    from onnxscript.function_libs.torch_lib.ops.core import aten_constant_pad_nd

    return aten_constant_pad_nd(self, [0, 0, *pad], value)


def _slice_scatter(self, src, dim: int = 0, start=None, end=None, step=1):
    from onnxscript.function_libs.torch_lib.ops.core import aten_slice_scatter

    return aten_slice_scatter(self, src, dim - 1 if dim < 0 else dim, start, end, step)


_COMPLEX_FORMS = {
    aten.resolve_conj.default: _resolve_conj,
    aten._conj_physical.default: _conj_physical,
    aten.mul.Scalar: _mul_scalar,
    aten.new_zeros.default: _new_zeros,
    aten.copy.default: _copy,
    aten.constant_pad_nd.default: _constant_pad_nd,
    aten.slice_scatter.default: _slice_scatter,
}


def register(registry) -> None:
    """Add the complex forms above to ``registry``."""
    from onnxscript import opset18
    from onnxscript.values import TracedOnnxFunction

    for target, fn in _COMPLEX_FORMS.items():
        registry.register_op(target, TracedOnnxFunction(opset18, fn), is_complex=True)
