"""The floating-point operations of a graph's float32 and float64 products (matrix
products and convolutions), read from its nodes' metadata with
``torch.utils.flop_counter``'s formulas: no run, no tracing. Other ops count nothing,
so the figure is a lower bound of the work (Tuner.surely_long)."""

from __future__ import annotations

import logging

import torch
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import flop_registry

logger = logging.getLogger("lort")


def product_flops(gm: torch.fx.GraphModule) -> int:
    """The float32 and float64 products' floating-point operations of one run of ``gm``
    (static sizes: a node whose sizes are symbolic, or whose formula fails, counts nothing)."""
    total = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
        val = node.meta.get("val")
        # Float32 and float64 only: products in bfloat16, float16 or int8 can run on
        # matrix units (AMX, VNNI) far past Tuner.peak_flops_per_thread.
        if formula is None or getattr(val, "dtype", None) not in (torch.float32, torch.float64):
            continue
        args, kwargs, out = tree_map_only(
            torch.fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs, val)
        )
        try:
            total += int(formula(*args, out_val=out, **kwargs))
        except Exception as e:  # noqa: BLE001 - symbolic sizes, or metadata the formula cannot read
            logger.debug("lort: no flop count for %s (%s)", node, e)
    return total
