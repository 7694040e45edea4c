"""Frozen weights at compile time: which of a group's inputs become ORT initializers,
and the model and session that hold them (Options.freeze; runtime/frozen.py checks them
on every call)."""

from __future__ import annotations

import logging

import onnx_ir as ir
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..numpy_views import numpy_view
from ..options import Options
from ..runtime.compiled import Boundary
from ..runtime.dtypes import SUPPORTED_DTYPES
from ..runtime.frozen import FrozenWeight
from ..translate import external_data, onnx_export
from . import quantize

logger = logging.getLogger("lort")


def choose(
    weights: dict[int, tuple[str, torch.Tensor]] | None, boundary: Boundary, device: torch.device,
    auto: bool = False, refused: str | None = None,
) -> tuple[tuple[FrozenWeight, ...], dict[str, int]]:
    """The weights among a group's inputs (``weights``: input index -> (name, tensor))
    that can be frozen, and how many stay inputs, by why. ``auto`` (freeze="auto")
    freezes only the weights the run-time check can guard against writes that bypass
    the version counter: those in CPU memory, where it samples an element. ``refused``:
    why none is frozen (the graph's weights exceed Options.freeze_max_mb)."""
    frozen, kept = [], {}
    for i, (name, t) in sorted((weights or {}).items()):
        why = refused or _why_kept(t, boundary.in_perms[i], device, auto)
        if why is None:
            frozen.append(FrozenWeight(i, name, t))
        else:
            kept[why] = kept.get(why, 0) + 1
    return tuple(frozen), kept


def _why_kept(t: torch.Tensor, perm, device: torch.device, auto: bool) -> str | None:
    """Why the weight ``t`` (entering its group in layout ``perm``) stays an input, or None."""
    if perm is not None:
        return "enters the group in a permuted layout"
    if t.device != device:
        return f"is on {t.device}, the group on {device}"
    if auto and t.device.type != "cpu":
        return (
            f"is on {t.device.type}, where freeze='auto' cannot see writes that bypass the version "
            "counter (p.data, DLPack); freeze=True freezes it"
        )
    if t.dtype not in SUPPORTED_DTYPES:
        return f"has dtype {t.dtype} (no NumPy type to embed it with)"
    if t.layout != torch.strided or t.is_sparse:
        return "is not a dense tensor"
    return None


def frozen_model(model: ir.Model, frozen: tuple[FrozenWeight, ...], tensors: list[torch.Tensor] | None = None) -> ir.Model:
    """``model`` with the frozen inputs as initializers holding ``tensors`` (the frozen
    weights' own tensors when None)."""
    tensors = [w.tensor for w in frozen] if tensors is None else tensors
    with unset_fake_temporarily():
        arrays = {w.index: _array(t) for w, t in zip(frozen, tensors)}
    return onnx_export.freeze_inputs(model, arrays)


def candidates(model: ir.Model, frozen: tuple[FrozenWeight, ...], options: Options,
               tensors: list[torch.Tensor] | None = None, fuse=None, skip_norms: bool = True) -> list:
    """Functions giving (``OnnxModel``, ORT fusions that fired), or None where the
    rewrite fails, to try in order: ORT-fused first (with ``options.ort_fusions``),
    then plain, with the weights frozen. The weights never enter the model's bytes:
    its initializers point ORT at the weights' own memory (translate/external_data.py),
    so no size limit applies. The rewrites run before the weights are frozen: with
    them as initializers, onnxscript's optimizer folded each linear layer's transposed
    weight into a new initializer (a copy of every such weight, BERT-base's 374 MB),
    where ORT folds it into the product or packs it once. With ``options.quantize``,
    the frozen weight matrices are then quantized (compile/quantize.py). ``fuse``: the rewrite
    (onnx_export.translate_group's; ``fuse_for_ort`` of ``model``, with ``skip_norms``,
    when None)."""

    def frozen_and_quantized(m: ir.Model) -> ir.Model:
        sources = {m.graph.inputs[w.index].name: t for w, t in zip(frozen, tensors or [w.tensor for w in frozen])}
        m = frozen_model(m, frozen, tensors)
        quantize.quantize_products(m, options, sources)  # nothing unless Options.quantize
        return m

    def fused():
        rewrite = fuse or (lambda serializer: onnx_export.fuse_for_ort(model, serializer=serializer,
                                                                       skip_norms=skip_norms))
        rewritten, fusions = rewrite(serializer=lambda m: m)
        if rewritten is None:
            return None
        return external_data.serialize(frozen_and_quantized(rewritten)), fusions

    def plain():
        return external_data.serialize(frozen_and_quantized(model)), {}

    return [fused, plain] if options.ort_fusions else [plain]


def _array(t: torch.Tensor):
    """A NumPy array over ``t``'s values (its own memory on CPU, where ORT then reads
    it in place)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return numpy_view(t.contiguous())
