"""Which ONNX Runtime execution providers run a group, from its tensors' device."""

from __future__ import annotations

import functools

import onnxruntime as ort
import torch

from ..errors import UnsupportedInputError
from . import cuda


@functools.lru_cache(maxsize=1)
def available() -> tuple[str, ...]:
    return tuple(ort.get_available_providers())


def for_device(device: torch.device, override: tuple | None = None, tf32: bool = False) -> list:
    """The provider list for a group whose tensors live on ``device``. On CUDA the
    provider runs on lort's stream for the device, with TF32 as ``tf32`` says
    (runtime/cuda.py); a CUDA provider in ``override`` gets the same stream."""
    if override:
        names = [p[0] if isinstance(p, tuple) else p for p in override]
        missing = [n for n in names if n not in available()]
        if missing:
            raise UnsupportedInputError(
                f"lort option providers names {missing}, which this onnxruntime does not have; "
                f"available: {list(available())}"
            )
        if device.type != "cuda":
            return list(override)
        index = cuda.device_index(device)
        return [
            ("CUDAExecutionProvider", cuda.provider_options(index, tf32, p[1] if isinstance(p, tuple) else None))
            if (p[0] if isinstance(p, tuple) else p) == "CUDAExecutionProvider"
            else p
            for p in override
        ]
    if device.type == "cpu":
        return ["CPUExecutionProvider"]
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in available():
            raise UnsupportedInputError(
                f"tensors are on {device} but onnxruntime has no CUDAExecutionProvider "
                f"(available: {list(available())}); install onnxruntime-gpu, or keep the model on CPU"
            )
        index = cuda.device_index(device)
        return [("CUDAExecutionProvider", cuda.provider_options(index, tf32)), "CPUExecutionProvider"]
    raise UnsupportedInputError(f"lort has no ORT execution provider for device {device}")


def device_check(device: torch.device) -> str | None:
    """Why a group on ``device`` cannot run in ORT, or None."""
    try:
        for_device(device)
    except UnsupportedInputError as e:
        return str(e)
    return None
