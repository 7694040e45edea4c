"""Which inputs of a Dynamo graph are a module's parameters and buffers: the weights an
inference graph may freeze into its ORT sessions (Options.freeze)."""

from __future__ import annotations

import re

import torch
import torch.fx

_ATTR = re.compile(r"\._(parameters|buffers)\['([^']+)'\]|\._modules\['([^']+)'\]|\.([A-Za-z_][A-Za-z0-9_]*)"
                   r"|\['([^']+)'\]|\[(\d+)\]")
#: The frame local a source starts from.
_ROOT = re.compile(r"^L\['([A-Za-z_][A-Za-z0-9_]*)'\]")
#: A source that reads a frame local through attributes, dict keys and indices only.
_CHAIN = re.compile(r"^L\['([A-Za-z_][A-Za-z0-9_]*)'\](?:\.[A-Za-z_][A-Za-z0-9_]*|\['[^']*'\]|\[\d+\])+$")


def module_weights(gm: torch.fx.GraphModule, example_inputs: list) -> dict[int, str]:
    """Index -> readable name ("encoder.layer.0.weight") of the Dynamo graph inputs
    that are a module's state: its parameters and registered buffers, and tensors it
    keeps in plain attributes (timm's LeViT caches its attention biases in a dict
    attribute) that need no gradient. Other inputs (activations, tensors the user
    passes) are never frozen, nor are Python numbers Dynamo passes as 0-d tensors
    (under ``dynamic=True`` a module's float attributes, such as a norm's epsilon, come
    in as a new tensor on every call). A frozen tensor that changes is seen by the run-time
    weight check (runtime/frozen.py), which freezes it again, or keeps it an input
    where it changes on every call."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return {}
    modules = {k for k, v in _frame_locals().items() if isinstance(v, torch.nn.Module)}
    out = {}
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if not isinstance(value, torch.Tensor) or value.requires_grad and not isinstance(value, torch.nn.Parameter):
            continue
        source = _source(node)
        if source is None or _python_number(node):
            continue
        if _is_registered(source) or isinstance(value, torch.nn.Parameter):
            out[i] = readable(source)
        elif not value.requires_grad and (m := _CHAIN.match(source)) is not None and m.group(1) in modules:
            out[i] = readable(source)
    return out


def _frame_locals() -> dict:
    """The locals of the frame Dynamo is compiling (call this from the backend); empty
    where it cannot be found (a Dynamo without this API: nothing is tied to a module)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return dict(tx.f_locals) if tx is not None else {}
    except Exception:  # noqa: BLE001
        return {}


def _source(node: torch.fx.Node) -> str | None:
    """Where Dynamo reads the graph input ``node`` from ("L['self']._modules['fc']..."),
    or None."""
    source = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
    source = source() if callable(source) else source
    return source if isinstance(source, str) else None


def _python_number(node: torch.fx.Node) -> bool:
    """Whether Dynamo passes the graph input ``node`` as a 0-d tensor made from a Python
    int or float on each call (its GraphArg's ``pass_arg_as_tensor``)."""
    return bool(getattr(node.meta.get("grapharg"), "pass_arg_as_tensor", False))


def _is_registered(source: str) -> bool:
    """Whether ``source`` reads a module's parameter or registered buffer."""
    return "._parameters[" in source or "._buffers[" in source


def _module_roots(gm: torch.fx.GraphModule, registered_only: bool) -> dict[str, torch.nn.Module]:
    """Frame local name -> module, for the modules the graph's inputs are read from
    (only through their parameters and buffers where ``registered_only``)."""
    f_locals, roots = _frame_locals(), {}
    for node in gm.graph.nodes:
        source = _source(node) if node.op == "placeholder" else None
        if source is None or registered_only and not _is_registered(source):
            continue
        match = _ROOT.match(source)
        obj = f_locals.get(match.group(1)) if match else None
        if isinstance(obj, torch.nn.Module):
            roots[match.group(1)] = obj
    return roots


def readable(source: str) -> str:
    """"L['self']._modules['fc']._parameters['weight']" -> "fc.weight"."""
    parts = []
    for m in _ATTR.finditer(re.sub(r"^L\['[^']*'\]", "", source)):
        parts.append(next(g for g in m.groups()[1:] if g is not None))
    parts = [p for p in parts if p not in ("_modules",)]
    return ".".join(parts) or source



def owners(gm: torch.fx.GraphModule) -> list:
    """The objects whose weights the Dynamo graph ``gm`` reads: the frame's locals its
    weight inputs come from (``L['self']`` for a module's ``forward``, ``L['fn']`` for a
    module compiled by ``torch.compile(module)``), looked up in the frame Dynamo is
    compiling (call this from the backend). Empty where they cannot be found."""
    return list({id(m): m for m in _module_roots(gm, registered_only=True).values()}.values())


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
    names = sorted(_module_roots(gm, registered_only=False))
    try:
        from torch._dynamo.guards import GuardBuilder, install_guard
        from torch._dynamo.source import LocalSource

        for name in names:
            install_guard(LocalSource(name).make_guard(GuardBuilder.ID_MATCH))
    except Exception:  # noqa: BLE001 - a Dynamo without these internals: no guard added
        return False
    return bool(names)
