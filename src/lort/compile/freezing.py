"""Frozen weights at compile time: which of a group's inputs become ORT initializers,
and the model and session that hold them (Options.freeze; runtime/frozen.py checks them
on every call)."""

from __future__ import annotations

import logging

import onnx_ir as ir
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..options import Options
from ..runtime.compiled import Boundary
from ..runtime.dtypes import SUPPORTED_DTYPES
from ..runtime.frozen import FrozenWeight
from ..translate import onnx_export

logger = logging.getLogger("lort")


def choose(
    weights: dict[int, tuple[str, torch.Tensor]] | None, boundary: Boundary, device: torch.device,
    auto: bool = False,
) -> tuple[tuple[FrozenWeight, ...], dict[str, int]]:
    """The weights among a group's inputs (``weights``: input index -> (name, tensor))
    that can be frozen, and how many stay inputs, by why. ``auto`` (freeze="auto")
    freezes only the weights the run-time check can guard against writes that bypass
    the version counter: those in CPU memory, where it samples an element."""
    frozen, kept = [], {}
    for i, (name, t) in sorted((weights or {}).items()):
        why = None
        if boundary.in_perms[i] is not None:
            why = "enters the group in a permuted layout"
        elif t.device != device:
            why = f"is on {t.device}, the group on {device}"
        elif auto and t.device.type != "cpu":
            why = (
                f"is on {t.device.type}, where freeze='auto' cannot see writes that bypass the version "
                "counter (p.data, DLPack); freeze=True freezes it"
            )
        elif t.dtype not in SUPPORTED_DTYPES:
            why = f"has dtype {t.dtype} (no NumPy type to embed it with)"
        elif t.layout != torch.strided or t.is_sparse:
            why = "is not a dense tensor"
        if why is None:
            frozen.append(FrozenWeight(i, name, t))
        else:
            kept[why] = kept.get(why, 0) + 1
    return tuple(frozen), kept


def frozen_model(model: ir.Model, frozen: tuple[FrozenWeight, ...], tensors: list[torch.Tensor] | None = None) -> ir.Model:
    """``model`` with the frozen inputs as initializers holding ``tensors`` (the frozen
    weights' own tensors when None)."""
    tensors = [w.tensor for w in frozen] if tensors is None else tensors
    with unset_fake_temporarily():
        arrays = {w.index: _array(t) for w, t in zip(frozen, tensors)}
    return onnx_export.freeze_inputs(model, arrays)


def candidates(model: ir.Model, frozen: tuple[FrozenWeight, ...], options: Options,
               tensors: list[torch.Tensor] | None = None) -> list:
    """Functions giving (model bytes, ORT fusions that fired), or None where the
    rewrite fails, to try in order: ORT-fused first (with ``options.ort_fusions``),
    then plain, with the weights frozen. Each is built only when tried, from arrays
    over the weights' own memory, so that one serialized copy of the weights exists at
    a time."""

    def fused():
        fused_bytes, fusions = onnx_export.fuse_for_ort(frozen_model(model, frozen, tensors), in_place=True)
        return None if fused_bytes is None else (fused_bytes, fusions)

    def plain():
        return onnx_export.serialize(frozen_model(model, frozen, tensors)), {}

    return [fused, plain] if options.ort_fusions else [plain]


def _array(t: torch.Tensor):
    """A NumPy array over ``t``'s values (its own memory on CPU: serializing the ONNX
    model copies it once)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.numpy() if t.is_contiguous() else t.contiguous().numpy()
