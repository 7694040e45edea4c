"""Attention as one ONNX node: PyTorch's CPU attention kernel in inference graphs
(``aten._scaled_dot_product_flash_attention_for_cpu``, which ``scaled_dot_product_attention``
dispatches to on float32 CPU tensors) as ONNX's ``Attention`` (opset 23), which ORT's
CPU provider runs as one kernel.

Attention's math form is about a dozen ONNX nodes (the key's transpose, two scalings,
two products, the softmax, the grouped heads' key and value repeated by Unsqueeze,
Expand and Reshape); on a CPU their per-node cost is most of the time at decoding's
sizes (one query row against a few dozen keys: 59 against 161 microseconds a layer for
12 query heads over 2 key/value heads, ORT 1.31, 2 threads). ``Attention`` takes the
same four-dimensional query, key and value, grouped key/value heads, a boolean or
additive mask broadcast to [batch, heads, queries, keys], ``is_causal`` aligned to the
top left (query i sees keys 0..i, as PyTorch's) and the scale.

Agreement with the CPU kernel (float32): within 4e-7 on every case above, and a row
whose mask hides every key gives zeros in both. One difference is left as it was: a
NaN in the query or key makes ORT's row NaN, as PyTorch's math form does, where the
CPU kernel returns numbers for it; lort's math form in ORT gave NaN there before this
lowering too.

Only the output is computed. The kernel's second output (the log-sum-exp a backward
reads) is never used in an inference graph; a graph that reads it keeps the op in
PyTorch (``lort.fusion.known_wrong``). Training graphs keep attention's math form
(``capture.aot``), whose backward ORT runs.

ONNX numbers ``Attention`` from opset 23; lort's other translations are written for
opset 18, whose ops keep their meaning in 23. A model holding ``Attention`` imports
the default domain at 23 (``finish``)."""

from __future__ import annotations

import onnx_ir as ir
import torch

aten = torch.ops.aten

#: The opset of ONNX's Attention operator.
ATTENTION_OPSET = 23
FLASH_FOR_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default


def _flash_attention_for_cpu(query, key, value, dropout_p: float = 0.0, is_causal: bool = False, attn_mask=None,
                             scale: float | None = None):
    """``_scaled_dot_product_flash_attention_for_cpu`` -> (output, log-sum-exp
    placeholder). ``dropout_p`` is 0 (the support checker's rule)."""
    from onnxscript import opset18 as op
    from onnxscript import opset23

    inputs = [query, key, value] + ([attn_mask] if attn_mask is not None else [])
    attributes = {"is_causal": 1 if is_causal else 0}
    if scale is not None:
        attributes["scale"] = float(scale)
    # The recorder gives the node all four of its outputs (the cache's present key and
    # value, the scores); ``finish`` keeps the first.
    output = opset23.Attention(*inputs, **attributes)[0]
    # [batch, heads, queries] of zeros: the shape of the kernel's log-sum-exp; never
    # read (a graph that reads it keeps the op in PyTorch).
    shape = op.Shape(query, start=0, end=3)
    lse = op.Expand(op.CastLike(op.Constant(value_float=0.0), query), shape)
    return output, lse


def register(registry) -> None:
    """Put the translation of the CPU attention kernel into ``registry``."""
    from onnxscript import opset18
    from onnxscript.values import TracedOnnxFunction

    registry.register_op(FLASH_FOR_CPU, TracedOnnxFunction(opset18, _flash_attention_for_cpu))


def finish(model: ir.Model) -> None:
    """Import the default domain at opset 23 where ``model`` holds ONNX's Attention (its
    functions too), and give each Attention node only its first output where nothing
    reads the others (ORT then writes no copy of the key and value as the cache's
    present ones)."""
    found = False
    for node in list(model.graph.all_nodes()):
        if node.op_type != "Attention" or node.domain not in ("", "ai.onnx"):
            continue
        found = True
        extra = node.outputs[1:]
        if any(v.uses() or v.is_graph_output() for v in extra):
            continue
        single = ir.Node(node.domain, "Attention", node.inputs, node.attributes.values(), num_outputs=1,
                         name=node.name, graph=None)
        out, old = single.outputs[0], node.outputs[0]
        out.name, out.type, out.shape = old.name, old.type, old.shape
        ir.convenience.replace_nodes_and_values(node.graph, node, [node], [single], [old], [out])
    if not found:
        return
    # The model's functions (torch_lib's, kept as functions) import the default domain at
    # the model's version too: onnx-ir's inliner, which onnxscript's rewrites run first,
    # refuses a function whose version differs.
    for holder in (model, *model.functions.values()):
        if holder.opset_imports.get("", 0) < ATTENTION_OPSET:
            holder.opset_imports[""] = ATTENTION_OPSET
