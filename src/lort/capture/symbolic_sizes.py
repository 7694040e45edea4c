"""Sizes read from the graph's inputs instead of from tensors it computes.

With dynamic shapes, a traced graph reads a size it needs as a number (a view's or an
expand's target) with ``aten.sym_size.int(t, dim)``. That node returns a SymInt, not a
tensor, so it stays in PyTorch; when ``t`` is computed in the graph (a decoder's key
cache after ``cat`` with the new token: ``sym_size(cat, 2)`` is ``past + 1``), the node
sits between the group that makes ``t`` and the ops that read the size, and the group
is cut there: GPT-2's decode step with dynamic cache lengths became 13 ORT groups, one a
layer, instead of one.

The size is known from the inputs: its symbolic expression is in the symbols of the
placeholders (a SymInt input, or a dimension of an input tensor). Each such
``sym_size`` is replaced by that arithmetic on the inputs' sizes (``operator.add`` and
``operator.mul`` on SymInts), computed before the first op, which every group may take
as an input without a cut. A size whose expression is anything else (a division, a
max, a symbol no input holds) is left as it was.
"""

from __future__ import annotations

import logging
import operator

import sympy
import torch
import torch.fx

logger = logging.getLogger("lort")

_SYM_SIZE = torch.ops.aten.sym_size.int


def sizes_from_inputs(gm: torch.fx.GraphModule) -> int:
    """Rewrites each ``sym_size`` of a computed tensor whose value is a sum of products of
    the inputs' symbols and integers (module docstring); returns how many."""
    graph = gm.graph
    nodes = list(graph.nodes)
    targets = [n for n in nodes if n.op == "call_function" and n.target is _SYM_SIZE
               and isinstance(n.args[0], torch.fx.Node) and n.args[0].op != "placeholder"
               and isinstance(n.meta.get("val"), torch.SymInt)]
    if not targets:
        return 0
    sources = _symbol_sources(nodes)
    first_op = next((n for n in nodes if n.op != "placeholder"), None)
    emitted: dict = {}
    done = 0
    for node in targets:
        expr = node.meta["val"].node.expr
        if not expr.free_symbols or not expr.free_symbols <= sources.keys():
            continue
        with graph.inserting_before(first_op):
            new = _emit(graph, expr, sources, emitted)
        if new is None:
            continue
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        done += 1
    if done:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
        logger.debug("lort: %d size(s) read from the graph's inputs", done)
    return done


def _symbol_sources(nodes: list) -> dict:
    """symbol -> (placeholder, dim or None): where each input symbol can be read; a SymInt
    input first, else the first input tensor dimension that is that symbol."""
    sources: dict = {}
    for n in nodes:
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.SymInt):
            expr = n.meta["val"].node.expr
            if isinstance(expr, sympy.Symbol):
                sources.setdefault(expr, (n, None))
    for n in nodes:
        val = n.meta.get("val") if n.op == "placeholder" else None
        if isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    sources.setdefault(size.node.expr, (n, d))
    return sources


def _emit(graph: torch.fx.Graph, expr, sources: dict, emitted: dict):
    """An FX node (or int) computing ``expr`` from the sources, with its SymInt as
    ``meta['val']``; None where ``expr`` is not a sum of products of symbols and integers."""
    if expr in emitted:
        return emitted[expr]
    if isinstance(expr, sympy.Integer):
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        ph, dim = sources[expr]
        if dim is None:
            out = ph
        else:
            out = graph.call_function(_SYM_SIZE, (ph, dim))
            out.meta["val"] = ph.meta["val"].shape[dim]
    elif isinstance(expr, (sympy.Add, sympy.Mul)):
        op = operator.add if isinstance(expr, sympy.Add) else operator.mul
        parts = [_emit(graph, a, sources, emitted) for a in expr.args]
        if any(p is None for p in parts):
            return None
        out = parts[0]
        for p in parts[1:]:
            if not isinstance(out, torch.fx.Node) and not isinstance(p, torch.fx.Node):
                out = op(out, p)
                continue
            val = op(_val(out), _val(p))
            out = graph.call_function(op, (out, p))
            out.meta["val"] = val
    else:
        return None
    emitted[expr] = out
    return out


def _val(x):
    return x.meta["val"] if isinstance(x, torch.fx.Node) else x
