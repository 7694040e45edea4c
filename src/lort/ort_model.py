"""An ONNX model as ORT takes it: its bytes, and the initializers they declare as
external data, held by tensors whose memory ORT reads in place (no size limit, no copy:
translate/external_data.py makes them, runtime/session.py hands them to ORT). A base
value: the compile stage builds it, the runtime runs it."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, eq=False)
class OnnxModel:
    """A model for ORT: its bytes, and the initializers they declare as external data:
    (name, the tensor whose memory holds the data (CPU or CUDA, contiguous; an integer
    tensor of the same width for a type torch lacks), its ONNX element type)."""

    proto: bytes
    external: tuple[tuple[str, torch.Tensor, int], ...] = ()

    @property
    def external_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t, _ in self.external)


def model_bytes(model: OnnxModel | bytes) -> bytes:
    """The serialized model (without the data of its external initializers)."""
    return model.proto if isinstance(model, OnnxModel) else model
