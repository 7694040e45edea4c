"""CUDA specifics of running ORT sessions beside PyTorch: stream order and TF32.

Stream order. ORT's CUDA execution provider runs its kernels on streams of its own, so
it could read a bound input before the PyTorch kernel on the current stream that
writes it has finished (measured on an H100: relative errors of 0.9 to 1.6 with a long
matmul right before the call). lort gives every session of a device one stream it
owns, as the provider's ``user_compute_stream`` (ORT ignores a null one, and PyTorch's
default stream is null, so PyTorch's own stream cannot be passed), and orders it with
PyTorch's current stream on each run, with no host synchronization:

    lort_stream.wait_stream(current)    # inputs written before ORT reads them
    run (RunOptions disable_synchronize_execution_providers=1: no end-of-run sync)
    current.wait_stream(lort_stream)    # outputs written before PyTorch reads them

Memory ORT still reads is safe from PyTorch's caching allocator: a freed block is
reused only by work ordered on the stream that allocated it, and that stream waits for
lort's stream after every run.

TF32. ORT's CUDA provider uses TF32 for float32 GEMMs and convolutions unless told not
to (``use_tf32``), where PyTorch does not by default for matmuls. ORT has one switch for
both, so lort turns it on only where PyTorch allows TF32 for matmuls
(``torch.backends.cuda.matmul.allow_tf32`` or ``torch.set_float32_matmul_precision``
"high"/"medium") and for cuDNN (``torch.backends.cudnn.allow_tf32``). The flag is part
of a session's key: changing PyTorch's setting builds (or reuses) the matching session.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_streams: dict[int, "torch.cuda.Stream"] = {}


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def lort_stream(index: int) -> "torch.cuda.Stream":
    """The stream every lort session on CUDA device ``index`` runs on (made once)."""
    stream = _streams.get(index)
    if stream is None:
        with _lock:
            stream = _streams.get(index)
            if stream is None:
                stream = _streams[index] = torch.cuda.Stream(device=index)
    return stream


def tf32_enabled() -> bool:
    """Whether PyTorch lets float32 matmuls and convolutions use TF32 right now."""
    matmul = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    return bool(matmul and torch.backends.cudnn.allow_tf32)


def provider_options(index: int, tf32: bool, user: dict | None = None) -> dict:
    """CUDA execution provider options for a lort session on device ``index``; options
    the user passed (``Options.providers``) are kept, except the stream, which lort owns."""
    opts = {str(k): str(v) for k, v in (user or {}).items()}
    opts.setdefault("device_id", str(index))
    opts.setdefault("use_tf32", "1" if tf32 else "0")
    opts["user_compute_stream"] = str(lort_stream(index).cuda_stream)
    return opts


class StreamOrder:
    """Orders one device's ORT runs with PyTorch's current stream (see the module doc)."""

    def __init__(self, index: int):
        self.index = index
        self.stream = lort_stream(index)

    def before_run(self) -> "torch.cuda.Stream":
        current = torch.cuda.current_stream(self.index)
        self.stream.wait_stream(current)
        return current

    def after_run(self, current: "torch.cuda.Stream") -> None:
        current.wait_stream(self.stream)


def synchronize(device: torch.device | None) -> None:
    """Host sync for timing (never on the run path); nothing off CUDA."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
