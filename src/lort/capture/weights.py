"""Which inputs of a Dynamo graph are a module's parameters and buffers: the weights an
inference graph may freeze into its ORT sessions (Options.freeze)."""

from __future__ import annotations

import re

import torch
import torch.fx

_ATTR = re.compile(r"\._(parameters|buffers)\['([^']+)'\]|\._modules\['([^']+)'\]|\.([A-Za-z_][A-Za-z0-9_]*)"
                   r"|\['([^']+)'\]|\[(\d+)\]")
#: A source that reads a frame local through attributes, dict keys and indices only.
_CHAIN = re.compile(r"^L\['([A-Za-z_][A-Za-z0-9_]*)'\](?:\.[A-Za-z_][A-Za-z0-9_]*|\['[^']*'\]|\[\d+\])+$")


def module_weights(gm: torch.fx.GraphModule, example_inputs: list) -> dict[int, str]:
    """Index -> readable name ("encoder.layer.0.weight") of the Dynamo graph inputs
    that are a module's state: its parameters and registered buffers, and tensors it
    keeps in plain attributes (timm's LeViT caches its attention biases in a dict
    attribute) that need no gradient. Other inputs (activations, tensors the user
    passes) are never frozen. A frozen tensor that changes is seen by the run-time
    weight check (runtime/frozen.py), which freezes it again, or keeps it an input
    where it changes on every call."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return {}
    modules = _module_locals()
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
        elif not value.requires_grad and (m := _CHAIN.match(source)) is not None and m.group(1) in modules:
            out[i] = readable(source)
    return out


def _module_locals() -> set[str]:
    """Names of the frame locals Dynamo is compiling that are modules (call this from
    the backend); empty where the frame cannot be found."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        f_locals = tx.f_locals if tx is not None else {}
    except Exception:  # noqa: BLE001 - a Dynamo without this: only parameters and buffers
        return set()
    return {k for k, v in f_locals.items() if isinstance(v, torch.nn.Module)}


def readable(source: str) -> str:
    """"L['self']._modules['fc']._parameters['weight']" -> "fc.weight"."""
    parts = []
    for m in _ATTR.finditer(re.sub(r"^L\['[^']*'\]", "", source)):
        parts.append(next(g for g in m.groups()[1:] if g is not None))
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


def guard_owner_identity(gm: torch.fx.GraphModule) -> bool:
    """Make Dynamo's cache entry for the graph ``gm`` match only the module instances it
    read its weights from (an ID_MATCH guard on each frame local owning them; call this
    from the backend, while Dynamo compiles the frame).

    Dynamo passes a module's parameters to the graph as inputs and guards on the
    module's structure, not its identity: a second instance of the same class reuses the
    first one's graph. An inference graph holds the weights it froze in its ORT sessions,
    so each instance needs its own graph: without this, two instances called in turn
    froze their weights again on every call (about 0.5 s each on RegNetY), then ran with
    the weights as inputs. Dynamo counts its recompile limit per ID_MATCH'd module, and
    drops the entry when the module is collected. False where this Dynamo has no such
    guard (the weight check then still sees the other instance's weights)."""
    try:
        from torch._dynamo.guards import GuardBuilder, install_guard
        from torch._dynamo.source import LocalSource
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        f_locals = tx.f_locals if tx is not None else {}
        names = set()
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            source = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
            source = source() if callable(source) else source
            match = _ROOT.match(source) if isinstance(source, str) else None
            if match and isinstance(f_locals.get(match.group(1)), torch.nn.Module):
                names.add(match.group(1))
        for name in sorted(names):
            install_guard(LocalSource(name).make_guard(GuardBuilder.ID_MATCH))
    except Exception:  # noqa: BLE001 - a Dynamo without these internals: no guard added
        return False
    return bool(names)
