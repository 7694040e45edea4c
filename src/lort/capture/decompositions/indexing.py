"""Decompositions of indexing ops torch_lib has no translation for, into ops it translates
exactly (registered by ``decompositions.table``):

* ``searchsorted`` as PyTorch's CPU binary search (``cus_lower_bound`` /
  ``cus_upper_bound``) run on every value at once: a fixed number of halving steps, each a
  gather and a compare, and the same ``!(mid >= value)`` / ``!(mid > value)`` tests, so
  NaN values, NaN in the sequence and unsorted sequences give PyTorch's indices.
* ``diagonal_scatter`` as a ``scatter`` into the flattened (dim1, dim2) plane, and float
  ``diagonal`` / ``diagonal_copy`` as a gather from it (torch_lib's diagonal, an identity
  mask times the plane, turned an inf off the diagonal into NaN on it).
* ``index_reduce`` (prod, amax, amin, mean) as ``scatter_reduce``; 'mean' is a sum and a
  count, divided as PyTorch's kernel divides (floor division for integers), since
  torch_lib's scatter_reduce has no 'mean'.
* ``scatter_reduce`` amax/amin of floats with PyTorch's NaN propagation restored (ORT's
  ScatterElements max/min do not propagate NaN), which index_reduce's amax/amin use too.
* ``cummax`` / ``cummin`` along a dimension of up to ``CUMULATIVE_MAX_LENGTH`` as
  comparisons of all pairs, with the indices PyTorch's loop gives (NaN, ties).
"""

from __future__ import annotations

import math
import threading

import torch

aten = torch.ops.aten


def _int64(value, like):
    return aten.scalar_tensor.default(value, dtype=torch.int64, device=like.device)


def searchsorted(sorted_sequence, values, *, out_int32=False, right=False, side=None, sorter=None):
    """aten.searchsorted.Tensor: each step halves [start, end) where start < end, exactly
    as PyTorch's kernel does, for ceil(log2(n + 1)) steps (the most it takes)."""
    if not isinstance(values, torch.Tensor) or values.dtype != sorted_sequence.dtype:
        return NotImplemented
    if values.dtype.is_complex or values.dtype == torch.bool:
        return NotImplemented
    if side is not None:
        right = side == "right"
    one_d = sorted_sequence.dim() == 1
    if not one_d and values.dim() == 0:
        return NotImplemented
    n = sorted_sequence.shape[-1]
    if sorter is not None:
        sorted_sequence = aten.gather.default(sorted_sequence, -1, sorter)
    start = aten.zeros.default(list(values.shape), dtype=torch.int64, device=values.device)
    end = aten.add.Tensor(start, _int64(n, values))
    last, two, one = _int64(max(n - 1, 0), values), _int64(2, values), _int64(1, values)
    for _ in range(int(n).bit_length() if n > 0 else 0):
        active = aten.lt.Tensor(start, end)
        mid = aten.add.Tensor(start, aten.floor_divide.default(aten.sub.Tensor(end, start), two))
        at = aten.minimum.default(mid, last)  # where the search has ended mid may be n
        if one_d:
            mid_value = aten.index.Tensor(sorted_sequence, [at])
        else:
            mid_value = aten.gather.default(sorted_sequence, -1, at)
        stop = aten.gt.Tensor(mid_value, values) if right else aten.ge.Tensor(mid_value, values)
        go_on = aten.logical_and.default(active, aten.logical_not.default(stop))
        start = aten.where.self(go_on, aten.add.Tensor(mid, one), start)
        end = aten.where.self(aten.logical_and.default(active, stop), mid, end)
    if out_int32:
        return aten._to_copy.default(start, dtype=torch.int32)
    return start


def _diagonal_plane(x, offset, dim1, dim2, length=None):
    """x with dim1, dim2 moved last and flattened, the flat positions of its diagonal
    ``offset`` (row * width + column; ``length`` of them, by default all), and the order
    the dims were moved in; None where the decompositions below do not apply."""
    nd = x.dim()
    if nd < 2 or dim1 % nd == dim2 % nd:
        return None
    d1, d2 = dim1 % nd, dim2 % nd
    rest = [d for d in range(nd) if d not in (d1, d2)]
    height, width = x.shape[d1], x.shape[d2]
    if length is None:
        length = max(0, min(height + min(offset, 0), width - max(offset, 0)))
    flat = aten.reshape.default(aten.permute.default(x, rest + [d1, d2]), [x.shape[d] for d in rest] + [height * width])
    first = max(-offset, 0) * width + max(offset, 0)
    positions = aten.arange.start_step(first, first + length * (width + 1), width + 1, dtype=torch.int64, device=x.device)
    return flat, positions, rest + [d1, d2]


def diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    """aten.diagonal_scatter: move dim1, dim2 last, flatten them, scatter ``src`` at the
    diagonal's flat positions (row * width + column), and move them back."""
    length = src.shape[-1] if src.dim() > 0 else 0
    plane = _diagonal_plane(x, offset, dim1, dim2, length)
    if plane is None or src.dtype != x.dtype:
        return NotImplemented
    flat, positions, order = plane
    if positions.shape[0] == 0:
        return aten.clone.default(x)
    positions = aten.expand.default(positions, list(src.shape))
    scattered = aten.scatter.src(flat, -1, positions, src)
    unflat = aten.reshape.default(scattered, [x.shape[d] for d in order])
    inverse = [order.index(d) for d in range(x.dim())]
    return aten.clone.default(aten.permute.default(unflat, inverse), memory_format=torch.contiguous_format)


def float_diagonal(x, offset=0, dim1=0, dim2=1):
    """aten.diagonal / diagonal_copy of a floating tensor as a gather of the diagonal's
    flat positions: torch_lib multiplies the plane by an identity mask and sums it, so an
    inf or NaN off the diagonal made the diagonal NaN (inf * 0)."""
    if not x.dtype.is_floating_point or any(isinstance(s, torch.SymInt) for s in x.shape):
        return NotImplemented
    plane = _diagonal_plane(x, offset, dim1, dim2)
    if plane is None or plane[1].shape[0] == 0:
        return NotImplemented
    flat, positions, _ = plane
    return aten.index_select.default(flat, -1, positions)


_tracing = threading.local()


def scatter_reduce_extremum(x, dim, index, src, reduce, *, include_self=True):
    """Float scatter_reduce amax/amin: ORT's ScatterElements max/min keep or drop a NaN by
    the order it meets it; PyTorch's result is NaN wherever a NaN (of ``src``, or of
    ``x`` when include_self) is reduced, which a count of the NaNs scattered there
    restores. Without include_self, the reached elements of ``x`` are first set to -inf
    (amax) / inf (amin): torch_lib sets them to the dtype's largest finite value, so an
    amax of -inf alone gave -3.4e38. Other reductions and dtypes are left to the op."""
    if reduce not in ("amax", "amin") or not x.dtype.is_floating_point or getattr(_tracing, "inner", False):
        return NotImplemented
    start = x
    if not include_self:  # torch_lib starts the reached elements at finfo.min/max, not -inf/inf
        fill = aten.full_like.default(src, -math.inf if reduce == "amax" else math.inf)
        start = aten.scatter.src(x, dim, index, fill)
    _tracing.inner = True  # the op below is the one ORT runs, not decomposed again
    try:
        out = aten.scatter_reduce.two(start, dim, index, src, reduce, include_self=True)
    finally:
        _tracing.inner = False
    nans = aten._to_copy.default(aten.isnan.default(src), dtype=x.dtype)
    has_nan = aten.gt.Scalar(aten.scatter_add.default(aten.zeros_like.default(x), dim, index, nans), 0)
    if include_self:
        has_nan = aten.logical_or.default(has_nan, aten.isnan.default(x))
    return aten.masked_fill.Scalar(out, has_nan, float("nan"))


def index_reduce(x, dim, index, source, reduce, *, include_self=True):
    """aten.index_reduce as scatter_reduce along ``dim`` with the index broadcast over
    ``source``; 'mean' as PyTorch's kernel computes it: (sum) / max(count, 1), counting
    ``self`` when include_self, floor division for integer dtypes."""
    if x.dtype.is_complex or x.dtype == torch.bool or reduce not in ("prod", "amax", "amin", "mean"):
        return NotImplemented
    if x.dim() == 0:  # a 0-d self and source reduce as one element of dimension 0
        if source.dim() != 0 or index.numel() != 1:
            return NotImplemented
        one = index_reduce(aten.view.default(x, [1]), 0, aten.view.default(index, [1]),
                           aten.view.default(source, [1]), reduce, include_self=include_self)
        return aten.view.default(one, [])
    if source.dim() != x.dim():
        return NotImplemented
    d = dim % x.dim()
    shape = [1] * x.dim()
    shape[d] = -1
    idx = aten.expand.default(aten.view.default(index, shape), list(source.shape))
    if reduce != "mean":  # float amax/amin: NaN as PyTorch (scatter_reduce_extremum)
        return aten.scatter_reduce.two(x, d, idx, source, reduce, include_self=include_self)
    total = aten.scatter_reduce.two(x, d, idx, source, "sum", include_self=include_self)
    counts = aten.full_like.default(x, 1 if include_self else 0)
    counts = aten.scatter_add.default(counts, d, idx, aten.full_like.default(source, 1))
    counts = aten.masked_fill.Scalar(counts, aten.eq.Scalar(counts, 0), 1)
    if x.dtype.is_floating_point:
        return aten.div.Tensor(total, counts)
    return aten.div.Tensor_mode(total, counts, rounding_mode="floor")


def table() -> dict:
    """The decompositions above, by the op they replace."""
    return {
        aten.searchsorted.Tensor: searchsorted,
        aten.diagonal_scatter.default: diagonal_scatter,
        aten.diagonal.default: float_diagonal,
        aten.diagonal_copy.default: float_diagonal,
        aten.index_reduce.default: index_reduce,
        aten.scatter_reduce.two: scatter_reduce_extremum,
        aten.cummax.default: _cumulative_extremum(True),
        aten.cummin.default: _cumulative_extremum(False),
    }


#: The longest dimension cummax/cummin compare all pairs of (L * L per row) along.
CUMULATIVE_MAX_LENGTH = 1024


def _cumulative_extremum(greater_equal: bool):
    """cummax (greater_equal) / cummin as PyTorch's CPU loop decides, written over all
    pairs j <= i: the index is the last NaN up to i if there is one, else the last j <= i
    holding the extremum of x[:i + 1] (ties go to the later index, as the loop's >= / <=
    does), and the value is x at that index (so -0.0 and 0.0 come out as eager's)."""

    def decomposition(x, dim):
        if x.dtype == torch.bool or x.dtype.is_complex:
            return NotImplemented
        if x.dim() == 0:
            return aten.clone.default(x), aten.zeros.default([], dtype=torch.int64, device=x.device)
        d = dim % x.dim()
        length = x.shape[d]
        if length == 0 or length > CUMULATIVE_MAX_LENGTH or x.numel() * length > 2**24:
            return NotImplemented
        moved = aten.movedim.int(x, d, -1)  # (..., L)
        row = aten.unsqueeze.default(moved, -2)  # x_j along the last dim, (..., 1, L)
        positions = aten.arange.default(length, dtype=torch.int64, device=x.device)
        up_to = aten.le.Tensor(aten.unsqueeze.default(positions, 0), aten.unsqueeze.default(positions, 1))  # [i, j]: j <= i
        if x.dtype.is_floating_point:
            fill = -math.inf if greater_equal else math.inf
        else:
            info = torch.iinfo(x.dtype)
            fill = info.min if greater_equal else info.max
        masked = aten.where.self(up_to, row, aten.scalar_tensor.default(fill, dtype=x.dtype, device=x.device))
        reduce = aten.amax.default if greater_equal else aten.amin.default
        extremum = aten.unsqueeze.default(reduce(masked, [-1]), -1)  # (..., L, 1)
        none = aten.scalar_tensor.default(-1, dtype=torch.int64, device=x.device)
        hits = aten.logical_and.default(up_to, aten.eq.Tensor(row, extremum))
        index = aten.amax.default(aten.where.self(hits, positions, none), [-1])
        if x.dtype.is_floating_point:
            nans = aten.logical_and.default(up_to, aten.isnan.default(row))
            last_nan = aten.amax.default(aten.where.self(nans, positions, none), [-1])
            index = aten.where.self(aten.ge.Scalar(last_nan, 0), last_nan, index)
        values = aten.gather.default(moved, -1, index)
        return aten.movedim.int(values, -1, d), aten.movedim.int(index, -1, d)

    decomposition.__name__ = "cummax" if greater_equal else "cummin"
    return decomposition
