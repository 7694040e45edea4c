"""Capture for lort.ORTModule's direct inference (Options.direct_inference): a module's
no-grad call as one ATen graph, by ``torch.export`` (non-strict) instead of Dynamo and
AOTAutograd, decomposed as the Dynamo path's inference graphs are, with its weights named.

The graph's placeholders are the module's parameters, buffers and tensor constants (the
weights an inference graph may freeze) and the call's input tensors. It must only read
its weights and inputs: a graph that mutates a buffer or an input is refused (the Dynamo
path runs it)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import warnings

import torch
import torch.fx
from torch.export.graph_signature import InputKind, OutputKind

from ..errors import CaptureError
from . import decompositions

logger = logging.getLogger("lort")

aten = torch.ops.aten



def _sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """SDPA as its math form, as in the Dynamo path's graphs. torch.export would pick a
    fused kernel (flash attention on CPU), whose decomposition gives its output other
    strides than the kernel's: a later ``view`` then fails (GPT-2). A boolean mask
    becomes the additive one the math form takes (0 where True, -inf where False), as
    ``scaled_dot_product_attention`` does before it calls it: the math form adds a
    boolean mask as 0 and 1 (Llama's causal mask without a cache: logits off by up to 4)."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
    return aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )[0]


#: What torch.export must decompose otherwise than AOTAutograd's table says.
_EXTRA = {aten.scaled_dot_product_attention.default: _sdpa_math}
#: Checks torch.export inserts (``x.to(dtype)`` metadata); the direct path's schema
#: checks the same at run time.
_ASSERTS = (aten._assert_tensor_metadata.default,)
_WEIGHT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


class ExportRefused(CaptureError):
    """The module's call cannot take the direct path (torch.export failed, or the graph
    mutates state); the Dynamo path runs it."""


@dataclasses.dataclass
class ExportedGraph:
    """An exported inference graph: ``gm``'s placeholders are ``example_inputs``;
    ``weights`` maps a placeholder to the weight's name and tensor (the module's own
    tensor), ``targets`` a weight that is an attribute of the module to its path there,
    ``user_inputs`` lists the placeholders of the call's tensors, in order."""

    gm: torch.fx.GraphModule
    example_inputs: list
    weights: dict[int, tuple[str, torch.Tensor]]
    targets: dict[int, str]
    user_inputs: list[int]


def _is_composite_implicit(op) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


@functools.lru_cache(maxsize=4)
def decomposition_table(decompose_conv_backward: bool, implemented: tuple[str, ...]) -> dict:
    """What the Dynamo path decomposes (lort's table, and every CompositeImplicitAutograd
    op, which AOTAutograd decomposes on its own), as torch.export's table."""
    lort_table = decompositions.table(decompose_conv_backward, implemented)
    table = torch.export.default_decompositions()
    for op in list(table.keys()):
        if op not in lort_table and not _is_composite_implicit(op):
            table.pop(op)
    for op, fn in lort_table.items():
        table[op] = fn
    table.update(_EXTRA)
    return table


_LEAFSPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def export_inference(module: torch.nn.Module, flat: list[torch.Tensor], table: dict,
                     prefix: str = "") -> ExportedGraph:
    """``module(*flat)`` (a tuple of tensors out) as an ``ExportedGraph``, traced without
    grad. ``prefix`` is stripped from the weights' names (the wrapper's attribute holding
    the user's module). Raises ExportRefused."""
    try:
        with torch.inference_mode(False), torch.no_grad():
            ep = torch.export.export(module, tuple(flat), strict=False)
            with warnings.catch_warnings():
                # torch 2.13's run_decompositions deep-copies its call graph's TreeSpecs,
                # which warns of its own deprecated LeafSpec: torch's noise, not the user's.
                warnings.filterwarnings("ignore", message=_LEAFSPEC_WARNING, category=FutureWarning)
                ep = ep.run_decompositions(table)
    except Exception as e:  # noqa: BLE001 - any failure to export sends the call to Dynamo
        raise ExportRefused(f"torch.export failed: {_first_line(e)}") from e
    sig = ep.graph_signature
    outputs = [s for s in sig.output_specs if s.kind != OutputKind.USER_OUTPUT]
    if outputs:
        raise ExportRefused(f"the graph writes {outputs[0].target} ({outputs[0].kind.name.lower()})")
    gm = ep.graph_module
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTS and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    example, weights, targets, user = [], {}, {}, []
    for i, spec in enumerate(sig.input_specs):
        if spec.kind == InputKind.USER_INPUT:
            example.append(flat[len(user)])
            user.append(i)
        elif spec.kind in _WEIGHT_KINDS:
            tensor, attribute = _weight(module, ep, spec)
            if attribute:
                targets[i] = spec.target
            name = spec.target[len(prefix):] if spec.target.startswith(prefix) else spec.target
            example.append(tensor)
            weights[i] = (name, tensor)
        else:
            raise ExportRefused(f"input {spec.arg} of kind {spec.kind.name.lower()}")
    if len(user) != len(flat):
        raise ExportRefused(f"the graph takes {len(user)} of the call's {len(flat)} tensors")
    return ExportedGraph(gm, example, weights, targets, user)


def _weight(module: torch.nn.Module, ep, spec) -> tuple[torch.Tensor, bool]:
    """The module's own tensor behind a weight placeholder (so that the run-time checks
    see writes to it), and True; a constant made while tracing is the exported
    program's, and False."""
    try:
        found = operator.attrgetter(spec.target)(module)
    except AttributeError:
        found = None
    if isinstance(found, torch.Tensor):
        return found, True
    if spec.target in ep.constants:
        return ep.constants[spec.target], False
    raise ExportRefused(f"weight {spec.target} not found on the module")


def _first_line(e: BaseException) -> str:
    while e.__cause__ is not None and not str(e).strip():
        e = e.__cause__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
