"""Dependencies between the nodes of an FX graph that a partition must respect: data
edges, the ordering edges that in-place ops impose on every alias of the tensor they
write (views, in-place results, items of a list of views), and the order of random ops:
each draws from PyTorch's RNG after the one before it in the graph, as eager draws them
(a dropout's mask depends on no value of the graph, so without that edge a schedule could
draw two masks in either order)."""

from __future__ import annotations

import operator

import torch
import torch.fx

from .support import draws_random


def _mutated_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    out = []
    schema = target._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node):
                out.append(value)
    return out


def _aliased_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input whose storage ``node``'s output shares (a view, an in-place op's
    result, an item of a list of views), or None."""
    if node.op != "call_function":
        return None
    target = node.target
    if target is operator.getitem:
        src = node.args[0]
        if isinstance(src, torch.fx.Node) and isinstance(src.target, torch._ops.OpOverload):
            if any(r.alias_info is not None for r in src.target._schema.returns):
                return src
        return None
    if not isinstance(target, torch._ops.OpOverload):
        return None
    schema = target._schema
    sets = set()
    any_set = False  # a list of views (split's Tensor(a)[]) has its alias set on the items
    for r in schema.returns:
        if r.alias_info is not None:
            sets |= set(r.alias_info.before_set)
            any_set = any_set or not r.alias_info.before_set
    if not sets and not any_set:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and (any_set or sets & set(arg.alias_info.before_set)):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node):
                return value
    return None


def _alias_classes(nodes: list[torch.fx.Node]) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """For each node, the nodes whose values share its storage (itself included)."""
    parent = {n: n for n in nodes}

    def find(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in nodes:
        src = _aliased_input(n)
        if src is not None and src in parent:
            parent[find(n)] = find(src)
    classes: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in nodes:
        classes.setdefault(find(n), []).append(n)
    return {n: classes[find(n)] for n in nodes}


class DepGraph:
    """Data edges plus the ordering edges that mutations impose, all index-increasing.

    A node that mutates a tensor is ordered after every earlier reader or writer of that
    tensor's storage (the tensor, its views, in-place results) and before every later one.
    """

    def __init__(self, nodes: list[torch.fx.Node]):
        self.index = {n: i for i, n in enumerate(nodes)}
        self.succ: dict[torch.fx.Node, set[torch.fx.Node]] = {n: set() for n in nodes}
        self.pred: dict[torch.fx.Node, set[torch.fx.Node]] = {n: set() for n in nodes}
        for n in nodes:
            for p in n.all_input_nodes:
                self._add(p, n)
        draws = [n for n in nodes if draws_random(n)]
        for a, b in zip(draws, draws[1:]):
            self._add(a, b)
        mutations = [(m, t) for m in nodes for t in _mutated_args(m)]
        if not mutations:
            return
        aliases = _alias_classes(nodes)
        for m, tensor in mutations:
            for alias in aliases[tensor]:
                for user in alias.users:
                    if user is m:
                        continue
                    if self.index[user] < self.index[m]:
                        self._add(user, m)
                    else:
                        self._add(m, user)

    def _add(self, a: torch.fx.Node, b: torch.fx.Node) -> None:
        if a is b:
            return
        self.succ[a].add(b)
        self.pred[b].add(a)
