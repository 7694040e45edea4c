"""Inputs of a group's shapes and dtypes that its timing runs on (compile time, under
FakeTensorMode: NumPy arrays, a model's own weights where it has them)."""

from __future__ import annotations

import numpy as np
import torch

from ..runtime.dtypes import TABLE
from .layout import static_shape

#: Synthetic timing inputs past this many bytes are not made: the group is not timed
#: (it runs on every thread, in ORT; the whole-graph choice against eager still applies).
SYNTHETIC_MAX_BYTES = 256 << 20


def synthetic_inputs(metas, real: dict | None = None) -> list | None:
    """Inputs of the placeholders' shapes and dtypes to time on (NumPy, as compilation
    runs under FakeTensorMode): ``real[i]`` (an array of the input's own values, a
    model's weight) where given, else integer zeros (valid indices) or random floats.
    None when a placeholder is not a tensor of static shape and timed dtype (bfloat16 is
    not), or the synthetic ones would take more than SYNTHETIC_MAX_BYTES.

    The synthetic inputs of one dtype are views of one buffer, the size of the largest:
    timing reads them and never writes them (a group holds no in-place op)."""
    real = real or {}
    shapes = []
    for i, m in enumerate(metas):
        dtype = TABLE.get(m.dtype) if isinstance(m, torch.Tensor) else None
        if dtype is None or dtype.numpy is None or static_shape(m) is None:
            return None
        shapes.append((static_shape(m), np.dtype(dtype.numpy), m.dtype.is_floating_point))
    pools: dict = {}
    for i, (shape, dtype, floating) in enumerate(shapes):
        if i not in real:
            size = max(int(np.prod(shape, dtype=np.int64)), pools.get((dtype, floating), 0))
            pools[(dtype, floating)] = size
    if sum(size * dtype.itemsize for (dtype, _), size in pools.items()) > SYNTHETIC_MAX_BYTES:
        return None
    rng = np.random.default_rng(0)
    for (dtype, floating), size in pools.items():
        if not floating:
            pools[(dtype, floating)] = np.zeros(size, dtype=dtype)
        elif dtype in (np.float32, np.float64):
            pools[(dtype, floating)] = rng.standard_normal(size, dtype=dtype)
        else:  # float16: drawn in float32 (NumPy draws no other type)
            pools[(dtype, floating)] = rng.standard_normal(size, dtype=np.float32).astype(dtype)
    return [real[i] if i in real else pools[(dtype, floating)][: int(np.prod(shape, dtype=np.int64))].reshape(shape)
            for i, (shape, dtype, floating) in enumerate(shapes)]
