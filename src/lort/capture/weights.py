"""Which inputs of a Dynamo graph are a module's parameters and buffers: the weights an
inference graph may freeze into its ORT sessions (Options.freeze)."""

from __future__ import annotations

import re

import torch
import torch.fx

_ATTR = re.compile(r"\._(parameters|buffers)\['([^']+)'\]|\._modules\['([^']+)'\]|\.([A-Za-z_][A-Za-z0-9_]*)")


def module_weights(gm: torch.fx.GraphModule, example_inputs: list) -> dict[int, str]:
    """Index -> readable name ("encoder.layer.0.weight") of the Dynamo graph inputs
    that are parameters or registered buffers of a module. Other inputs (activations,
    tensors the user passes) are never frozen."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return {}
    out = {}
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if not isinstance(value, torch.Tensor) or value.requires_grad and not isinstance(value, torch.nn.Parameter):
            continue
        grapharg = node.meta.get("grapharg")
        source = getattr(getattr(grapharg, "source", None), "name", None)
        source = source() if callable(source) else source
        if not isinstance(source, str):
            continue
        if "._parameters[" in source or "._buffers[" in source or isinstance(value, torch.nn.Parameter):
            out[i] = readable(source)
    return out


def readable(source: str) -> str:
    """"L['self']._modules['fc']._parameters['weight']" -> "fc.weight"."""
    parts = []
    for m in _ATTR.finditer(source):
        parts.append(m.group(2) or m.group(3) or m.group(4))
    parts = [p for p in parts if p not in ("_modules",)]
    return ".".join(parts) or source
