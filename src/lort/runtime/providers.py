"""Which ONNX Runtime execution providers run a group, from its tensors' device."""

from __future__ import annotations

import functools

import onnxruntime as ort
import torch

from ..errors import UnsupportedInputError


@functools.lru_cache(maxsize=1)
def available() -> tuple[str, ...]:
    return tuple(ort.get_available_providers())


def for_device(device: torch.device, override: tuple | None = None) -> list:
    """The provider list for a group whose tensors live on ``device``."""
    if override:
        names = [p[0] if isinstance(p, tuple) else p for p in override]
        missing = [n for n in names if n not in available()]
        if missing:
            raise UnsupportedInputError(
                f"lort option providers names {missing}, which this onnxruntime does not have; "
                f"available: {list(available())}"
            )
        return list(override)
    if device.type == "cpu":
        return ["CPUExecutionProvider"]
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in available():
            raise UnsupportedInputError(
                f"tensors are on {device} but onnxruntime has no CUDAExecutionProvider "
                f"(available: {list(available())}); install onnxruntime-gpu, or keep the model on CPU"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        return [("CUDAExecutionProvider", {"device_id": str(index)}), "CPUExecutionProvider"]
    raise UnsupportedInputError(f"lort has no ORT execution provider for device {device}")


def device_check(device: torch.device) -> str | None:
    """Why a group on ``device`` cannot run in ORT, or None."""
    try:
        for_device(device)
    except UnsupportedInputError as e:
        return str(e)
    return None
