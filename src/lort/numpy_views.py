"""NumPy arrays over CPU tensors' memory that leave the tensors as they were.

``Tensor.numpy()`` marks the tensor's storage as not resizable, for good: FSDP2 frees an
unsharded parameter with ``untyped_storage().resize_(0)``, which then raises "Trying to
resize storage that is not resizable". lort reads users' tensors (frozen weights, timing
feeds, the weight guard, save_onnx) through ``numpy_view`` instead: an array over the
same memory through NumPy's array interface, which holds the tensor alive and changes
nothing of it.
"""

from __future__ import annotations

import functools

import numpy as np
import torch


class _Holder:
    """Keeps the tensor alive for as long as an array over its memory lives."""

    __slots__ = ("tensor", "__array_interface__")

    def __init__(self, tensor: torch.Tensor, interface: dict):
        self.tensor = tensor
        self.__array_interface__ = interface


@functools.lru_cache(maxsize=None)
def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """NumPy's dtype for ``dtype`` (TypeError for dtypes NumPy lacks, as ``numpy()``)."""
    return torch.empty(0, dtype=dtype).numpy().dtype


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A writeable NumPy array over the CPU tensor ``t``'s memory, with its strides; no
    copy and no change to ``t`` (unlike ``t.numpy()``)."""
    t = t.detach()
    if t.device.type != "cpu":
        raise ValueError(f"numpy_view needs a CPU tensor, got one on {t.device}")
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    dtype = numpy_dtype(t.dtype)
    if t.numel() == 0:
        return np.empty(tuple(t.shape), dtype=dtype)
    interface = {
        "version": 3,
        "shape": tuple(t.shape),
        "typestr": dtype.str,
        "descr": dtype.descr,
        "data": (t.data_ptr(), False),
        "strides": tuple(s * dtype.itemsize for s in t.stride()),
    }
    return np.asarray(_Holder(t, interface))
