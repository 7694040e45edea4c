"""Attention's safe softmax in inference graphs, without its row-wide select.

Attention's math form (how lort traces scaled_dot_product_attention) computes
``_safe_softmax(scores)``, which PyTorch decomposes as::

    out = softmax(scores); masked = scores == -inf
    where(all(masked, dim=-1, keepdim=True), 0, out)    # 0 on a row of -inf only

In ORT the ``all`` and the select broadcast over a row (a reduction, casts and a Where
whose condition is one value a row), which costs several times the softmax itself.
``where(masked, 0, out)`` selects element by element instead. It differs from the
above only on a row that has both a -inf and a NaN or +inf: softmax gives that row NaN
everywhere, and the elementwise form gives 0 where the score is -inf. When the
probabilities only feed the left side of a matrix product over that row (``attn @ v``:
through views, expands, clones and dropout's scaling), such a row still has a NaN, so
the product's row is NaN, as PyTorch's. So the rewrite is done only there, and only in
inference graphs: in training, the backward reads the probabilities themselves.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.fx

aten = torch.ops.aten
logger = logging.getLogger("lort")

#: Ops between the probabilities and the matrix product that keep the last dimension
#: (the row the softmax normalises) as the last dimension, element for element.
_PASS_THROUGH = {
    aten.view.default, aten._unsafe_view.default, aten.expand.default, aten.clone.default,
    aten.reshape.default, aten.alias.default,
}
_SCALE = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}
_PRODUCTS = {aten.bmm.default, aten.mm.default, aten.matmul.default}


def elementwise_safe_softmax(gm: torch.fx.GraphModule) -> int:
    """Rewrites, in an inference graph, each safe softmax whose probabilities only feed
    the left side of a matrix product (module docstring); returns how many."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.where.self:
            continue
        masked = _row_mask(node)
        if masked is None or not _only_left_of_products(node):
            continue
        row_all = node.args[0]
        node.args = (masked, *node.args[1:])
        if not row_all.users:
            gm.graph.erase_node(row_all)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
        logger.debug("lort: %d safe softmax(es) select element by element", done)
    return done


def _row_mask(where: torch.fx.Node) -> torch.fx.Node | None:
    """For ``where(all(scores == -inf, -1, keepdim), zeros, softmax(scores, -1))``, the
    ``scores == -inf`` node; else None."""
    cond, zeros, out = where.args[:3] if len(where.args) >= 3 else (None, None, None)
    if not all(isinstance(n, torch.fx.Node) for n in (cond, zeros, out)):
        return None
    if cond.target is not aten.all.dim or len(cond.args) < 3 or cond.args[2] is not True:
        return None
    masked = cond.args[0]
    if not isinstance(masked, torch.fx.Node) or masked.target is not aten.eq.Scalar:
        return None
    scores, value = masked.args[:2]
    if not (isinstance(value, float) and value == -math.inf):
        return None
    if out.target is not aten._softmax.default or zeros.target is not aten.zeros_like.default:
        return None
    if zeros.args[0] is not out:
        return None
    source = out.args[0]
    if source.target is aten._to_copy.default and source.args[0] is scores:  # softmax(..., dtype=)
        source = scores
    if source is not scores:
        return None
    rank = _rank(scores)
    if rank is None or not _last(cond.args[1], rank) or not _last(out.args[1], rank):
        return None
    if _shape(masked) != _shape(out):
        return None
    return masked


def _only_left_of_products(node: torch.fx.Node) -> bool:
    """Whether every use of ``node`` reaches the left side of a matrix product whose
    contraction runs over ``node``'s last dimension, through ops that keep it last."""
    last = _shape(node)
    if not last:
        return False
    last = last[-1]
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if not current.users:
            return False  # unused (a graph output is a user that is not a call: below)
        for user in current.users:
            if user.op != "call_function":
                return False
            if user.target in _PRODUCTS:
                if user.args[0] is not current or current in user.args[1:]:
                    return False
                continue
            if user.target in _PASS_THROUGH or (user.target in _SCALE and user.args[0] is current
                                                and current not in user.args[1:]):
                if (_shape(user) or [None])[-1] != last:
                    return False
                stack.append(user)
                continue
            return False
    return True


def _shape(node: torch.fx.Node) -> list | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return list(val.shape) if isinstance(val, torch.Tensor) else None


def _rank(node: torch.fx.Node) -> int | None:
    shape = _shape(node)
    return None if shape is None else len(shape)


def _last(dim, rank: int) -> bool:
    """Whether ``dim`` (an int or a one-element list) is the last dimension."""
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and dim % rank == rank - 1
