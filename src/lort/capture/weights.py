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


_ROOT = re.compile(r"^L\['([A-Za-z_][A-Za-z0-9_]*)'\]")


def owners(gm: torch.fx.GraphModule) -> list:
    """The objects whose weights the Dynamo graph ``gm`` reads: the frame's locals its
    weight inputs come from (``L['self']`` for a module's ``forward``, ``L['fn']`` for a
    module compiled by ``torch.compile(module)``), looked up in the frame Dynamo is
    compiling (call this from the backend). Empty where they cannot be found."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        f_locals = tx.f_locals if tx is not None else {}
    except Exception:  # noqa: BLE001 - a Dynamo without this: no owner, nothing tied to one
        return []
    roots = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        source = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
        source = source() if callable(source) else source
        if not isinstance(source, str) or not ("._parameters[" in source or "._buffers[" in source):
            continue
        match = _ROOT.match(source)
        obj = f_locals.get(match.group(1)) if match else None
        if isinstance(obj, torch.nn.Module):
            roots[id(obj)] = obj
    return list(roots.values())
