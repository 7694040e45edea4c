"""Timing a group at compile time: synthetic inputs of its real shapes, and runs of its
PyTorch graph (on CPU or CUDA, synchronized around the timed region only)."""

from __future__ import annotations

import numpy as np
import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .layout import inverse, static_shape
from .session import GroupSession, median_run_time


#: NumPy dtypes of the synthetic timing inputs (a bfloat16 group is not timed).
_NP_DTYPES = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


def synthetic_inputs(metas) -> list | None:
    """Inputs of the placeholders' shapes and dtypes to time a session on (NumPy, as
    compilation runs under FakeTensorMode); integer inputs are zeros (valid indices)."""
    rng = np.random.default_rng(0)
    out = []
    for m in metas:
        if not isinstance(m, torch.Tensor) or static_shape(m) is None or m.dtype not in _NP_DTYPES:
            return None
        np_dtype = _NP_DTYPES[m.dtype]
        if m.dtype.is_floating_point:
            out.append(rng.standard_normal(static_shape(m)).astype(np_dtype))
        else:
            out.append(np.zeros(static_shape(m), dtype=np_dtype))
    return out


def time_pytorch(gm: torch.fx.GraphModule, feeds: list, perms: list, device: torch.device) -> float | None:
    """Median seconds of a run of ``gm`` on ``feeds`` (real tensors: compilation runs
    under FakeTensorMode, which this leaves for the measurement) on ``device``; feeds
    are in physical order, ``perms`` gives each input back its layout."""
    with unset_fake_temporarily(), torch.no_grad():
        args = [
            _tensor(f, device) if p is None else _tensor(f, device).permute(inverse(p))
            for f, p in zip(feeds, perms)
        ]
        return median_run_time(lambda: gm(*args), device=device)


def time_session(sess: GroupSession, feeds: list, device: torch.device) -> float | None:
    """Median seconds of a run of a group's session on ``feeds`` moved to ``device``
    (its real run path: IOBinding, and on CUDA lort's stream ordering)."""
    with unset_fake_temporarily():
        args = [_tensor(f, device) for f in feeds]
        return median_run_time(lambda: sess.run(args), device=device)


def _tensor(feed: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(feed)
    return t if device.type == "cpu" else t.to(device)
