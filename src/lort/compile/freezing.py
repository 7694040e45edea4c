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
    weights: dict[int, tuple[str, torch.Tensor]] | None, boundary: Boundary, device: torch.device
) -> tuple[tuple[FrozenWeight, ...], dict[str, int]]:
    """The weights among a group's inputs (``weights``: input index -> (name, tensor))
    that can be frozen, and how many stay inputs, by why."""
    frozen, kept = [], {}
    for i, (name, t) in sorted((weights or {}).items()):
        why = None
        if boundary.in_perms[i] is not None:
            why = "enters the group in a permuted layout"
        elif t.device != device:
            why = f"is on {t.device}, the group on {device}"
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
               tensors: list[torch.Tensor] | None = None) -> list[tuple[bytes, dict]]:
    """(model bytes, ORT fusions that fired) to try in order: ORT-fused first (with
    ``options.ort_fusions``), then plain, with the weights frozen."""
    source = frozen_model(model, frozen, tensors)
    out = [(onnx_export.serialize(source), {})]
    if options.ort_fusions:
        fused, fusions = onnx_export.fuse_for_ort(source)
        if fused is not None:
            out.insert(0, (fused, fusions))
    return out


def _array(t: torch.Tensor):
    """A NumPy array over ``t``'s values (its own memory on CPU: serializing the ONNX
    model copies it once)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.numpy() if t.is_contiguous() else t.contiguous().numpy()
