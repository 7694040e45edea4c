"""Python float scalars of float64 graphs, translated exactly where torch_lib can be made to.

torch.onnx's type-promotion pass turns the scalar of ``mul.Tensor(x, 3.14)`` (and of the
other ops it promotes) into ``scalar_tensor(3.14, dtype=float64)``, and torch_lib
translates scalar_tensor as ``Cast(Constant(float32(s)), to=dtype)``: the value is rounded
to float32 first (3.14 is off by 1e-7; finfo(float64).min becomes -inf, and
logcumsumexp's gradient NaN). ``scalar_tensor`` below writes the constant in its own
dtype instead, exact for every dtype; lort registers it ahead of torch_lib's. A scalar that still reaches torch_lib as a Python float after promotion (an
ONNX float attribute such as leaky_relu's slope, which is float32 by the format) keeps
its node in PyTorch (``float64_scalar_reason``).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
import torch

from . import _compat, complex_ops
from .fx_graphs import single_node_graph

aten = torch.ops.aten


def _scalar_tensor(s: float, dtype: int = -1, layout: str = "", device: str = "", pin_memory: bool = False):
    """aten::scalar_tensor as a Constant of its dtype (float32 when unspecified, as torch_lib);
    a symbolic ``s`` (a size under dynamic shapes, a graph value) is cast, as torch_lib does."""
    from onnxscript import opset18 as op

    if dtype == -1:
        dtype = ir.DataType.FLOAT.value
    parts = complex_ops.PARTS.get(dtype)
    if parts is not None:  # lort's complex form: float pairs (translate/complex_ops.py)
        numpy_type = ir.DataType(parts).numpy()
        if not isinstance(s, (bool, int, float, complex)):
            imag = op.Constant(value=ir.tensor(np.zeros(1, numpy_type)))
            return op.Concat(op.Reshape(op.Cast(s, to=parts), [1]), imag, axis=0)
        value = complex(s)
        return op.Constant(value=ir.tensor(np.array([value.real, value.imag], dtype=numpy_type)))
    if not isinstance(s, (bool, int, float)):
        return op.Cast(s, to=dtype)
    return op.Constant(value=ir.tensor(np.array(s, dtype=ir.DataType(dtype).numpy())))


def register(registry) -> None:
    """Put the exact scalar_tensor ahead of torch_lib's in ``registry``."""
    from onnxscript import opset18
    from onnxscript.values import TracedOnnxFunction

    registry.register_op(aten.scalar_tensor.default, TracedOnnxFunction(opset18, _scalar_tensor))


def _rounded_float(node: torch.fx.Node) -> str | None:
    """The first float argument of ``node`` that float32 would round, as 'name=value'; an
    argument left out counts with its schema default (leaky_relu's slope 0.01), which
    the translation writes just the same."""
    target = node.target
    for i, arg in enumerate(target._schema.arguments):
        if i < len(node.args):
            value = node.args[i]
        elif arg.name in node.kwargs:
            value = node.kwargs[arg.name]
        else:
            value = arg.default_value if arg.has_default_value() else None
        if (
            isinstance(value, float)
            and math.isfinite(value)
            and (abs(value) > float(np.finfo(np.float32).max) or float(np.float32(value)) != value)
        ):
            return f"{arg.name}={value!r}"
    return None


def _touches_float64(node: torch.fx.Node) -> bool:
    tensors = [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes]
    flat = [t for v in tensors for t in (v if isinstance(v, (tuple, list)) else [v])]
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in flat)


def float64_scalar_reason(node: torch.fx.Node) -> str | None:
    """Why a node of a float64 graph stays in PyTorch: a Python float argument float32
    cannot hold that the translation would still make a float32 constant or attribute
    (mul.Tensor(x, 3.14) and leaky_relu(x, 0.1) on float64 were off by float32 rounding,
    1.8e-7 absolute). Scalars the type-promotion pass makes scalar_tensor nodes are exact."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target is aten.scalar_tensor.default:
        return None
    if not _touches_float64(node):
        return None
    rounded = _rounded_float(node)
    if rounded is None:
        return None
    try:
        gm = single_node_graph(node)
        _compat.insert_type_promotion(gm)
        left = [
            _rounded_float(n)
            for n in gm.graph.nodes
            if n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload)
            and n.target is not aten.scalar_tensor.default
        ]
        left = [r for r in left if r]
    except Exception:  # noqa: BLE001 - keep the node in PyTorch when unsure
        left = [rounded]
    if not left:
        return None
    return f"float64 graph: the translation makes its float argument {left[0]} a float32 constant, which would round it"
