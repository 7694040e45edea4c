"""The floating-point operations of a graph's products (matrix products, convolutions,
attention), read from its nodes' metadata with ``torch.utils.flop_counter``'s formulas:
no run, no tracing. Other ops count nothing, so the figure is a lower bound of the work
(Tuner.surely_long)."""

from __future__ import annotations

import logging

import torch
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import flop_registry

logger = logging.getLogger("lort")


def product_flops(gm: torch.fx.GraphModule) -> int:
    """The products' floating-point operations of one run of ``gm`` (static sizes: a node
    whose sizes are symbolic, or whose formula fails, counts nothing)."""
    total = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
        if formula is None:
            continue
        args, kwargs, out = tree_map_only(
            torch.fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs, node.meta.get("val"))
        )
        try:
            total += int(formula(*args, out_val=out, **kwargs))
        except Exception as e:  # noqa: BLE001 - symbolic sizes, or metadata the formula cannot read
            logger.debug("lort: no flop count for %s (%s)", node, e)
    return total
