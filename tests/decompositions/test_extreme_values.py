"""Translations that differed from PyTorch on extreme values (NaN, inf, signed zero,
values near the dtype's limits), found by the conformance sweep's extreme-value sample
(lort.testing.conformance_extreme): each op through lort against eager PyTorch."""

import math

import pytest
import torch

from test_decompositions_ops import _through_lort as _through_lort_with_backend

NAN, INF = math.nan, math.inf
DTYPES = [torch.float32, torch.float64]


def _through_lort(fn, *args):
    """fn(*args) through lort (every group in ORT) and eager's result."""
    got, expected, _ = _through_lort_with_backend(fn, *args)
    return got, expected


def _same(got, expected):
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fn", [
    lambda x: x + 1e-8, lambda x: x - 1e-9, lambda x: 1e-8 + x, lambda x: x * 1.000001, lambda x: x / 1.000001,
])
def test_constants_near_zero_or_one_are_not_no_ops(fn):
    # onnxscript's optimizer took c within 1e-8 of 0 (1e-5 relative of 1) for a no-op.
    _same(*_through_lort(fn, torch.tensor([0.0, 1.0, 3.0])))


def test_isclose_of_tiny_differences():
    got, expected = _through_lort(torch.isclose, torch.tensor([-0.0, 1e-30, INF, NAN]),
                                  torch.tensor([1e-30, 0.0, INF, NAN]))
    assert got.tolist() == expected.tolist() == [True, True, True, False]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", [
    lambda x: torch.clamp_min(x, 1e-12), lambda x: torch.clamp_max(x, 5.0), lambda x: torch.clamp(x, min=0),
    lambda x: torch.clamp(x, max=0.5), lambda x: torch.clamp_min(x, torch.tensor(0.5, dtype=x.dtype)),
    lambda x: torch.nn.functional.normalize(x.reshape(2, 3), dim=1),
])
def test_one_sided_clamp_keeps_infinities(fn, dtype):
    # ORT's Clip without a second bound clamps inf to the largest finite value.
    x = torch.tensor([INF, -INF, 1.0, NAN, 0.2, 3e38], dtype=dtype)
    _same(*_through_lort(fn, x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", [torch.diag, torch.diagonal_copy, torch.trace, lambda x: x.diagonal() + 1])
def test_diagonal_ignores_what_is_off_it(fn, dtype):
    # torch_lib's diagonal multiplies the plane by an identity mask: inf * 0 = NaN.
    x = torch.tensor([[1.0, INF, NAN], [-INF, 2.0, 3.0], [NAN, 1e30, -0.5]], dtype=dtype)
    _same(*_through_lort(fn, x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_angle_of_nan(dtype):
    _same(*_through_lort(torch.angle, torch.tensor([NAN, -1.0, 0.0, -INF, 2.0], dtype=dtype)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_logcumsumexp_does_not_underflow(dtype):
    # torch_lib subtracted the max of the whole dimension: [0, 500] gave [-inf, 500].
    x = torch.tensor([[0.0, 500.0, -INF, INF, 1.0, NAN, 2.0], [0.0, 1.0, 2.0, 200.0, -3.0, 4.0, 5.0]], dtype=dtype)
    got, expected = _through_lort(lambda x: torch.logcumsumexp(x, 1), x)
    torch.testing.assert_close(got, expected, equal_nan=True)
    assert got[0, 0] == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ord", [INF, -INF])
def test_infinity_norms_propagate_nan(ord, dtype):
    x = torch.tensor([[0.0, 5.0, NAN, 1.0], [1.0, -7.0, 2.0, 3.0]], dtype=dtype)
    for fn in (lambda x: torch.linalg.vector_norm(x, ord), lambda x: torch.linalg.vector_norm(x, ord, dim=1)):
        _same(*_through_lort(fn, x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduce", ["amax", "amin"])
def test_scatter_reduce_without_self_keeps_infinities(reduce, dtype):
    # torch_lib started the reached elements at the dtype's largest finite value.
    x = torch.zeros(3, dtype=dtype)
    src = torch.tensor([-INF, -INF, INF, INF, 1.0], dtype=dtype)
    index = torch.tensor([0, 0, 1, 1, 2])
    _same(*_through_lort(lambda x, s: x.scatter_reduce(0, index, s, reduce, include_self=False), x, src))


@pytest.mark.parametrize("dtype", DTYPES)
def test_log1p_of_tiny_values(dtype):
    # torch_lib's log(1 + x) gave 0 for |x| below epsilon (xlog1py(3e38, 1e-30) gave 0).
    x = torch.tensor([1e-30, -1e-30, -0.0, 0.0, 1e-10, -1.0, -2.0, INF, -INF, NAN, 0.5, 3e38], dtype=dtype)
    got, expected = _through_lort(torch.log1p, x)
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=2e-7, atol=0)
    assert torch.signbit(got[2]) and not torch.signbit(got[3])
    big = torch.tensor([3e38, INF], dtype=dtype)
    got, expected = _through_lort(torch.special.xlog1py, big, torch.tensor([1e-30, -1e-30], dtype=dtype))
    torch.testing.assert_close(got, expected, rtol=2e-7, atol=0)
