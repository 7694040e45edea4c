"""Floor division, remainder, truncating integer division and fmax/fmin
(lort.capture.decompositions.rounding) against eager PyTorch, exactly: values where
``floor(a / b)`` is off by one, signs, zero divisors, inf and NaN, Python numbers on
either side; through lort with every node in ORT."""

import math

import pytest
import torch

from lort.capture.decompositions import rounding as dr
from test_decompositions_ops import _all_in_ort, _through_lort

VALUES = [7.0, -7.0, 0.1, -0.1, 1.0, 0.0, -0.0, 3.0, -2.5, 1e30, -1e-30, math.inf, -math.inf, math.nan, 5.5, 69.0]


def _pairs(dtype):
    a = torch.tensor(VALUES, dtype=dtype).repeat_interleave(len(VALUES))
    b = torch.tensor(VALUES, dtype=dtype).repeat(len(VALUES))
    return a[:-1], b[:-1]  # an odd length: a tail past the last full vector


def _exact(got, expected):
    """Equal values, and zeros of the same sign (assert_close takes -0.0 == 0.0).
    ORT's Where gives +0.0 where it selects a -0.0 from its first value input, so the
    decompositions keep signed zeros in the second."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    if expected.is_floating_point():
        zero = expected == 0
        assert torch.equal(torch.signbit(got[zero]), torch.signbit(expected[zero])), "a zero of the wrong sign"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_floor_division_is_eagers(dtype):
    a, b = _pairs(dtype)
    assert torch.floor_divide(torch.tensor(7.0, dtype=dtype), 0.1) == 69  # not floor(7 / 0.1)

    def f(x, y):
        return torch.floor_divide(x, y), torch.div(x, y, rounding_mode="floor"), torch.floor_divide(x, 0.1)

    got, expected, backend = _through_lort(f, a, b)
    for g, e in zip(got, expected):
        _exact(g, e)  # a zero quotient has the sign of a / b
        assert (torch.signbit(e) & (e == 0)).sum() > 4
    _all_in_ort(backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_remainder_is_eagers(dtype):
    a, b = _pairs(dtype)
    finite = torch.isfinite(a) & torch.isfinite(b) & (a.abs() < 1e20)  # eager's vectorized fmod overflows a / b

    def f(x, y):
        return torch.remainder(x, y), torch.remainder(x, 0.1), torch.remainder(3.0, y), 7.5 % y

    got, expected, backend = _through_lort(f, a, b)
    for g, e in zip(got, expected):
        _exact(g[finite], e[finite])
    _all_in_ort(backend)
    assert float(got[1][a == 7.0][0]) == pytest.approx(float(torch.remainder(torch.tensor(7.0, dtype=dtype), 0.1)))


def test_floor_division_of_integers_by_a_float_promotes():
    a = torch.tensor([7, -7, 3, 0])
    got, expected, backend = _through_lort(lambda x: (torch.floor_divide(x, 0.1), torch.remainder(x, -0.3)), a)
    for g, e in zip(got, expected):
        _exact(g, e)
    _all_in_ort(backend)


def test_integer_truncating_division_is_exact():
    a = torch.tensor([7, -7, 7, -7, 0, 33554435, -33554435, 2**40 + 1, -(2**40) - 3, 6, -6])
    b = torch.tensor([2, 2, -2, -2, 5, 2, 2, 3, 7, -3, 3])
    got, expected, backend = _through_lort(lambda x, y: (torch.div(x, y, rounding_mode="trunc"),
                                                         torch.div(x, 4, rounding_mode="trunc")), a, b)
    for g, e in zip(got, expected):
        _exact(g, e)
    _all_in_ort(backend)


def test_integer_division_by_zero_raises_as_eager_does():
    a, b = torch.tensor([7, -7]), torch.tensor([2, 0])
    f = lambda x, y: torch.div(x, y, rounding_mode="trunc")  # noqa: E731
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        f(a, b)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        _through_lort(f, a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_fmax_fmin_ignore_one_nan(dtype):
    if dtype.is_floating_point:
        a, b = _pairs(dtype)
    else:
        a, b = torch.tensor([3, -1, 0, 9]), torch.tensor([2, -5, 0, 10])

    got, expected, backend = _through_lort(lambda x, y: (torch.fmax(x, y), torch.fmin(x, y)), a, b)
    for g, e in zip(got, expected):
        _exact(g, e)
        if dtype.is_floating_point:  # ties between 0.0 and -0.0 give the first operand
            assert (torch.signbit(e) & (e == 0)).sum() > 4
    _all_in_ort(backend)


def test_rounding_decompositions_leave_integers_to_torch_lib():
    a, b = torch.tensor([7, -7]), torch.tensor([2, 3])
    assert dr.floor_divide(a, b) is NotImplemented
    assert dr.remainder(a, b) is NotImplemented
    assert dr.div_rounding(a, b, rounding_mode="floor") is NotImplemented
    assert dr.div_rounding(a.double(), b, rounding_mode="trunc") is NotImplemented
