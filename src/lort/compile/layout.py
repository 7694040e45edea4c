"""Tensor layouts at a group's boundary: static shapes, symbolic dims, and permuted
layouts that cross into ORT in physical order (a transposed weight, a channels-last
activation) with the Transpose inside the ONNX model."""

from __future__ import annotations

import torch
import torch.fx
from torch._prims_common import is_non_overlapping_and_dense_or_false


def static_shape(t: torch.Tensor) -> tuple[int, ...] | None:
    dims = []
    for d in t.shape:
        if not isinstance(d, int):
            return None
        dims.append(d)
    return tuple(dims)


def is_symbolic(val) -> bool:
    if isinstance(val, (list, tuple)):
        return any(is_symbolic(v) for v in val)
    return isinstance(val, torch.SymInt) or (isinstance(val, torch.Tensor) and static_shape(val) is None)


def needs_restride(t: torch.Tensor) -> tuple | None:
    """The meta strides of an output when they are static, dense and not contiguous
    (a permuted layout that PyTorch code after the group may rely on)."""
    shape = static_shape(t)
    if shape is None or t.is_contiguous():
        return None
    if not is_non_overlapping_and_dense_or_false(t):
        return None
    try:
        stride = tuple(int(s) for s in t.stride())
    except (TypeError, RuntimeError):
        return None
    return shape, stride


def dense_perm(t) -> list[int] | None:
    """For a tensor whose layout is a permutation of a contiguous one (a transposed
    weight, a channels-last activation), the permutation ``p`` such that
    ``t.permute(p)`` is contiguous; None for contiguous, symbolic or other layouts.

    Groups take and give such tensors in their physical order, with the Transpose
    inside the ONNX model (where ORT folds it into MatMul or Gemm), instead of copying
    them to or from contiguous memory."""
    if not isinstance(t, torch.Tensor) or needs_restride(t) is None:
        return None
    stride = [int(s) for s in t.stride()]
    perm = sorted(range(t.dim()), key=lambda d: (-stride[d], d))
    if not t.permute(perm).is_contiguous() or perm == list(range(t.dim())):
        return None
    return perm


def inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def physical_graph(gm: torch.fx.GraphModule, in_perms: list, out_perms: list) -> torch.fx.GraphModule:
    """A copy of ``gm`` that takes permuted-layout inputs and gives permuted-layout
    outputs in physical (contiguous) order, with permutes inside the graph."""
    graph = torch.fx.Graph()
    val_map: dict = {}
    out = graph.graph_copy(gm.graph, val_map)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, perm in zip(placeholders, in_perms):
        if perm is None:
            continue
        logical = node.meta["val"]
        with graph.inserting_after(node):
            view = graph.call_function(torch.ops.aten.permute.default, (node, inverse(perm)))
        node.replace_all_uses_with(view, delete_user_cb=lambda u: u is not view)
        node.meta = {**node.meta, "val": logical.permute(perm).contiguous()}
        view.meta = {"val": logical}
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    for i, perm in enumerate(out_perms):
        if perm is None:
            continue
        logical = outs[i].meta["val"]
        phys = graph.call_function(torch.ops.aten.permute.default, (outs[i], perm))
        phys.meta = {"val": logical.permute(perm).contiguous()}
        outs[i] = phys
    graph.output(tuple(outs))
    return torch.fx.GraphModule(gm, graph)
