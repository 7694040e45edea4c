"""lort's decompositions of indexing ops (lort.capture.decompositions.indexing) against
eager PyTorch, exactly: the decomposition itself on many inputs (NaN, unsorted sequences,
0-d tensors, every dim and offset), and the op through lort with every node in ORT."""

import itertools
import math

import pytest
import torch

from lort.capture.decompositions import indexing as di
from test_decompositions_ops import _all_in_ort, _through_lort


def _search_cases(dtype):
    """(sequence, values) pairs: sorted and unsorted, with NaN and inf, empty, batched."""
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        n = int(torch.randint(0, 9, (), generator=g))
        if dtype.is_floating_point:
            seq = torch.randn(n, generator=g).round().to(dtype)
            values = torch.randn(4, 5, generator=g).round().to(dtype)
            if trial % 3 == 0 and n:
                seq[int(torch.randint(0, n, (), generator=g))] = math.nan
            values[0, :2] = math.nan if trial % 4 == 0 else values[0, :2]
            values[1, 1] = math.inf if trial % 5 == 0 else -math.inf
        else:
            seq = torch.randint(-3, 4, (n,), generator=g, dtype=dtype)
            values = torch.randint(-4, 5, (4, 5), generator=g, dtype=dtype)
        if trial % 2 == 0:
            seq = seq.sort().values
        if trial % 7 == 0:
            seq = seq.expand(4, n).clone()
            seq[2] = seq[2].flip(0)
        yield seq, values
    yield torch.tensor([1, 2, 3], dtype=dtype), torch.tensor(2, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_searchsorted_equals_aten(dtype):
    for seq, values in _search_cases(dtype):
        for right, side, use_sorter, out_int32 in itertools.product(
            (False, True), (None, "left", "right"), (False, True), (False, True)
        ):
            if right and side == "left":
                continue  # PyTorch rejects the pair
            sorter = seq.argsort(dim=-1) if use_sorter else None
            kwargs = dict(right=right, side=side, sorter=sorter, out_int32=out_int32)
            expected = torch.searchsorted(seq, values, **kwargs)
            got = di.searchsorted(seq, values, **kwargs)
            assert got.dtype == expected.dtype
            torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m: f"{seq} {values} {kwargs}: {m}")


def test_searchsorted_leaves_mixed_dtypes_alone():
    assert di.searchsorted(torch.arange(3), torch.tensor([1.5])) is NotImplemented


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_searchsorted_through_lort(dtype):
    seq = torch.tensor([-2.0, 0.0, 0.0, 1.5, 3.0, math.nan][: 6 if dtype.is_floating_point else 5]).to(dtype)
    values = torch.tensor([[-3.0, 0.0, 1.0], [3.0, 9.0, -2.0]]).to(dtype)
    if dtype.is_floating_point:
        values[1, 1] = math.nan

    def f(s, v):
        return torch.searchsorted(s, v), torch.searchsorted(s, v, right=True, out_int32=True)

    got, expected, backend = _through_lort(f, seq, values)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    _all_in_ort(backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_diagonal_scatter_equals_aten(dtype):
    torch.manual_seed(0)
    for shape in [(3, 3), (4, 2), (2, 5), (2, 3, 4), (3, 1, 4, 2), (0, 3), (3, 0)]:
        x = (torch.randn(shape) * 5).to(dtype)
        nd = len(shape)
        for d1, d2 in itertools.permutations(range(-nd, nd), 2):
            if d1 % nd == d2 % nd:
                continue
            for offset in range(-5, 6):
                src = (torch.randn(x.diagonal(offset, d1, d2).shape) * 5).to(dtype)
                expected = torch.diagonal_scatter(x, src, offset, d1, d2)
                got = di.diagonal_scatter(x, src, offset, d1, d2)
                torch.testing.assert_close(got, expected, rtol=0, atol=0)
                assert got.stride() == expected.stride()


def test_diagonal_scatter_through_lort():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    src = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)  # x.diagonal(-1, 2, 0)

    def f(x, src):
        return torch.diagonal_scatter(x, src, -1, 2, 0) * 2

    got, expected, backend = _through_lort(f, x, src)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    cotangent = torch.randn_like(expected)
    for g, e in zip(torch.autograd.grad(got, (x, src), cotangent), torch.autograd.grad(expected, (x, src), cotangent)):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    _all_in_ort(backend)


REDUCTIONS = ("prod", "mean", "amax", "amin")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_index_reduce_equals_aten(dtype):
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        x = (torch.randn(4, 5, 3, generator=g) * 5).to(dtype)
        for dim in (0, 1, 2, -1):
            k = int(torch.randint(0, 6, (), generator=g))
            index = torch.randint(0, x.shape[dim], (k,), generator=g)
            shape = list(x.shape)
            shape[dim] = k
            source = (torch.randn(shape, generator=g) * 5).to(dtype)
            if dtype.is_floating_point and trial % 5 == 0 and source.numel():
                source.view(-1)[0] = math.nan
            for reduce, include_self in itertools.product(REDUCTIONS, (True, False)):
                expected = x.index_reduce(dim, index, source, reduce, include_self=include_self)
                got = di.index_reduce(x, dim, index, source, reduce, include_self=include_self)
                torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_index_reduce_zero_dim_equals_aten(dtype):
    values = (2.5, -3.0, 0.0, math.nan, math.inf) if dtype.is_floating_point else (2, -3, 0, 7)
    for a, b in itertools.product(values, repeat=2):
        x, source = torch.tensor(a, dtype=dtype), torch.tensor(b, dtype=dtype)
        for reduce, include_self in itertools.product(REDUCTIONS, (True, False)):
            expected = x.index_reduce(0, torch.tensor([0]), source, reduce, include_self=include_self)
            got = di.index_reduce(x, 0, torch.tensor([0]), source, reduce, include_self=include_self)
            torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_index_reduce_through_lort(dtype):
    torch.manual_seed(0)
    x = (torch.randn(5, 3) * 4).to(dtype)
    source = (torch.randn(6, 3) * 4).to(dtype)
    if dtype.is_floating_point:
        source[1, 2] = math.nan
    index = torch.tensor([0, 2, 2, 4, 0, 2])

    def f(x, source):
        return tuple(
            x.index_reduce(0, index, source, reduce, include_self=include_self)
            for reduce, include_self in itertools.product(REDUCTIONS, (True, False))
        )

    if dtype.is_floating_point:
        x.requires_grad_()
        source.requires_grad_()
    got, expected, backend = _through_lort(f, x, source)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12 if dtype.is_floating_point else 0, atol=0, equal_nan=True)
    _all_in_ort(backend)
    if dtype.is_floating_point:
        cotangent = torch.randn(5, 3, dtype=dtype)
        g_got = torch.autograd.grad([o * cotangent for o in got], (x, source), [torch.ones(5, 3, dtype=dtype)] * 8)
        g_exp = torch.autograd.grad([o * cotangent for o in expected], (x, source), [torch.ones(5, 3, dtype=dtype)] * 8)
        for g, e in zip(g_got, g_exp):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_cummax_cummin_equal_aten(dtype):
    """Values, signs of zeros and indices (NaN, ties) exactly as eager's."""
    g = torch.Generator().manual_seed(0)
    pairs = ((torch.cummax, di._cumulative_extremum(True)), (torch.cummin, di._cumulative_extremum(False)))
    for trial in range(120):
        shape = [int(v) for v in torch.randint(1, 6, (int(torch.randint(1, 4, (), generator=g)),), generator=g)]
        x = torch.randint(-3, 4, shape, generator=g).to(dtype)
        if dtype.is_floating_point:
            x = x * 0.5
            x[torch.rand(shape, generator=g) < 0.15] = math.nan
            x[torch.rand(shape, generator=g) < 0.2] = -0.0
            x[torch.rand(shape, generator=g) < 0.1] = math.inf if trial % 2 else -math.inf
        for dim, (eager, mine) in itertools.product(range(-len(shape), len(shape)), pairs):
            e_values, e_indices = eager(x, dim)
            values, indices = mine(x, dim)
            torch.testing.assert_close(indices, e_indices, rtol=0, atol=0)
            torch.testing.assert_close(values, e_values, rtol=0, atol=0, equal_nan=True)
            assert torch.equal(torch.signbit(values), torch.signbit(e_values))
    for eager, mine in pairs:
        x = torch.tensor(-0.0, dtype=dtype)
        assert [torch.equal(a, b) for a, b in zip(mine(x, 0), eager(x, 0))] == [True, True]


def test_cummax_long_dimensions_are_left_alone():
    assert di._cumulative_extremum(True)(torch.zeros(di.CUMULATIVE_MAX_LENGTH + 1), 0) is NotImplemented


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_cummax_cummin_through_lort(dtype):
    x = torch.tensor([[1.0, 3.0, 3.0, -2.0, 5.0], [0.0, -0.0, math.nan, 4.0, math.nan]]).to(dtype)
    if not dtype.is_floating_point:
        x = torch.tensor([[1, 3, 3, -2, 5], [0, 7, 7, -9, 2]])
    if dtype.is_floating_point:
        x.requires_grad_()

    def f(x):
        return torch.cummax(x, 1), torch.cummin(x, 0)

    got, expected, backend = _through_lort(f, x)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.values, e.values, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(g.indices, e.indices, rtol=0, atol=0)
    _all_in_ort(backend)
    if dtype.is_floating_point:
        cotangent = torch.randn(2, 5, dtype=dtype)
        g_got = torch.autograd.grad((got[0].values * cotangent).nansum() + got[1].values.nansum(), x)[0]
        g_exp = torch.autograd.grad((expected[0].values * cotangent).nansum() + expected[1].values.nansum(), x)[0]
        torch.testing.assert_close(g_got, g_exp, rtol=0, atol=0)


@pytest.mark.parametrize("reduce", ["amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("flip", [False, True], ids=["nan-second", "nan-first"])
def test_scatter_reduce_extremum_propagates_nan(reduce, include_self, flip):
    """ORT's ScatterElements max/min keep or drop a NaN by the order it meets it (the
    flipped source gave 5 where PyTorch gives NaN); PyTorch propagates it."""
    src = torch.tensor([1.0, math.nan, 3.0, 2.0, 5.0, math.nan, -1.0, 4.0])
    src = src.flip(0) if flip else src
    index = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])

    def fn(s):
        return torch.tensor([0.0, math.nan, 1.0, 2.0]).scatter_reduce(0, index, s, reduce, include_self=include_self)

    got, expected, backend = _through_lort(fn, src)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    _all_in_ort(backend)
