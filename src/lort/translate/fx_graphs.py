"""FX graphs lort builds around one node of a group."""

from __future__ import annotations

import operator

import torch
import torch.fx


def single_node_graph(node: torch.fx.Node) -> torch.fx.GraphModule:
    """A graph that runs ``node`` alone (its getitems too), to find which node of a
    group fails to translate or to run in ORT."""
    g = torch.fx.Graph()
    env = {}
    for i, a in enumerate(node.all_input_nodes):
        ph = g.placeholder(f"in_{i}")
        ph.meta = dict(a.meta)
        env[a] = ph
    copy = g.node_copy(node, lambda a: env[a])
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        outs = []
        for i in range(len(val)):
            item = g.call_function(operator.getitem, (copy, i))
            item.meta["val"] = val[i]
            outs.append(item)
        g.output(tuple(outs))
    else:
        g.output((copy,))
    return torch.fx.GraphModule(torch.nn.Module(), g)
