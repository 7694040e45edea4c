"""Decompositions of single ops whose torch_lib translation fails on some inputs, into
ops it translates exactly (registered by ``decompositions.table``).

* Reductions over a dimension of a 0-d tensor: ONNX's ReduceMax/ReduceMin reject an
  axis on a rank-0 input ("axis must be in [-rank, rank-1]. Input rank was 0"), so
  torch_lib's amax/amin and any/all with a dim failed to build. On a 0-d tensor amax and
  amin are the value itself and any/all are ``x != 0``.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _zero_dim(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 0


def _chain(fn, previous):
    """``fn``, falling back to ``previous`` (an earlier decomposition of the same op, or
    none) where ``fn`` returns NotImplemented."""
    if previous is None:
        return fn

    def decomposition(*args, **kwargs):
        out = fn(*args, **kwargs)
        return previous(*args, **kwargs) if out is NotImplemented else out

    decomposition.__name__ = fn.__name__
    return decomposition


def zero_dim_extremum(x, dim=(), keepdim=False):
    """amax/amin of a 0-d tensor over dim [], 0 or -1: the value (NaN included)."""
    if not _zero_dim(x):
        return NotImplemented
    return aten.clone.default(x)


def zero_dim_any_all(x, dim=None, keepdim=False):
    """any/all of a 0-d tensor over a dim: whether the value is nonzero (NaN is). uint8
    inputs (whose any/all are uint8) are left alone."""
    if not _zero_dim(x) or x.dtype == torch.uint8:
        return NotImplemented
    if x.dtype == torch.bool:
        return aten.clone.default(x)
    return aten.ne.Scalar(x, 0)


def table(previous: dict) -> dict:
    """lort's single-op decompositions; each falls back to ``previous``'s decomposition
    of the same op where it does not apply."""
    own = {
        aten.amax.default: zero_dim_extremum,
        aten.amin.default: zero_dim_extremum,
        aten.any.dim: zero_dim_any_all,
        aten.any.dims: zero_dim_any_all,
        aten.all.dim: zero_dim_any_all,
        aten.all.dims: zero_dim_any_all,
    }
    return {op: _chain(fn, previous.get(op)) for op, fn in own.items()}
