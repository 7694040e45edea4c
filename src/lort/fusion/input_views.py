"""Views of a graph's inputs that leave the graph, or feed PyTorch nodes, are taken in
PyTorch: free there, a copy out of ORT.

A group's output is a new tensor ORT writes. Where that output is a chain of view ops on
an input of the graph (``t(weight)``, ``view(tangent)``), PyTorch would give the same
values as a view, without a copy. AOTAutograd's forward graph returns such views for the
backward (a linear layer saves ``t(weight)``): out of ORT, every layer's transposed weight
was a copy held from forward to backward, as much memory again as the weights
(BERT-base: 326 of the 425 MiB the forward saved; benchmarks/results/training.md).

The pass (``split_input_views``) copies each such chain for its consumers outside ORT
(the graph's output, nodes the support check refused) and leaves the copy to PyTorch;
consumers that ORT runs keep the original, which the fuser groups with them. The backward
graph then gets a permuted view of the weight, which crosses into ORT in its physical order
(compile/layout.py): no copy there either.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..reasons import Reason, ReasonKind
from .fuser import is_view_op

#: Meta key of a copy whose original stays in the graph (for ORT's consumers): reports
#: (diagnostics/records.py) count the op once.
DUPLICATE = "lort_view_copy"

REASON = Reason(ReasonKind.VIEW_OF_INPUT, "a view of the graph's input, free in PyTorch (ORT would copy it)")


def _view_root(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """The node a chain of view ops ends at (``node`` itself if it is no view), and the
    view ops from it to ``node``, in order."""
    chain = []
    n = node
    while n.op == "call_function" and n.target is not operator.getitem and is_view_op(n) and n.args \
            and isinstance(n.args[0], torch.fx.Node):
        chain.append(n)
        n = n.args[0]
    return n, chain[::-1]


def _chain(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The view ops from a placeholder to ``node`` (in order), or None where ``node`` is
    not a view of a placeholder through view ops alone."""
    root, chain = _view_root(node)
    if not chain or root.op != "placeholder" or not isinstance(root.meta.get("val"), torch.Tensor):
        return None
    if any(not isinstance(n.meta.get("val"), torch.Tensor) for n in chain):
        return None
    return chain


def _mutated_inputs(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Placeholders that an op of the graph may write (through a view or not): a view of
    one would show the written values where ORT's copy, and the functional graph, hold
    the values before the write. Their views are left alone."""
    out = set()
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
            continue
        for a in node.all_input_nodes:
            root, _ = _view_root(a)
            if root.op == "placeholder":
                out.add(root)
    return out


def split_input_views(graph: torch.fx.Graph, unsupported: dict) -> set[torch.fx.Node]:
    """Give each view-of-input chain's consumers outside ORT (the output node, nodes in
    ``unsupported``) a copy of the chain that stays in PyTorch; add the copies to
    ``unsupported`` (with ``REASON``). Returns the nodes made. Views that only nodes ORT
    may run consume are left alone."""
    made: set[torch.fx.Node] = set()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    mutated = _mutated_inputs(graph)
    for node in list(graph.nodes):
        if node in made or node in unsupported:
            continue
        outside = [u for u in node.users if u.op == "output" or u in unsupported]
        if not outside:
            continue
        chain = _chain(node)
        if chain is None or chain[0].args[0] in mutated or any(n in unsupported for n in chain):
            continue
        for n in chain:
            if n in copies:
                continue
            with graph.inserting_after(n):
                c = graph.node_copy(n, lambda a: copies.get(a, a))
            copies[n] = c
            made.add(c)
            unsupported[c] = REASON
        for u in outside:
            u.replace_input_with(node, copies[node])
    for n in reversed(list(graph.nodes)):  # originals no consumer uses any more
        if n in copies and not n.users:
            graph.erase_node(n)
        elif n in copies:  # a second node for one op of the captured graph: reports count one
            copies[n].meta[DUPLICATE] = True
    return made
