"""lort's lgamma, digamma, polygamma (lort.capture.decompositions.special) and Bessel
functions j0, j1, y0, y1, spherical j0 (decompositions_bessel) against eager PyTorch within the
conformance sweep's tolerances (float32 rtol 1.3e-4 / atol 1e-4, float64 1e-7): the
decompositions themselves on PyTorch's edge values (zeros of both signs, negative
integers, inf, NaN, tiny and huge x) and random ones, and the ops through lort (values,
and gradients where the op has them) with every node in ORT."""

import math

import pytest
import torch

from lort.backend import LortBackend
from lort.capture.decompositions import bessel as db
from lort.capture.decompositions import special as ds

TOLERANCES = {torch.float32: (1.3e-4, 1e-4), torch.float64: (1e-7, 1e-7)}

EDGES = [0.0, -0.0, 1.0, 2.0, -1.0, -2.0, -3.0, 0.5, -0.5, -2.5, 1e-30, -1e-30, 1e-8, 1.4616321, 9.999999,
         10.0, 10.5, 1e8, 1e17, 1e20, -1e6 + 0.25, -100.3, -3.0001, -8.3156849, 7.38, math.inf, -math.inf, math.nan]
EDGES_FLOAT64 = [1e-300, 1e300, -1e300, 1e-310, -1e20 + 0.5, -2.9999999999]


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    edges = EDGES + (EDGES_FLOAT64 if dtype == torch.float64 else [])
    return torch.cat([
        torch.tensor(edges, dtype=dtype),
        ((torch.rand(2000, generator=g, dtype=torch.float64) - 0.5) * 20).to(dtype),
        (torch.rand(300, generator=g, dtype=torch.float64) * 200).to(dtype),
        (torch.randn(300, generator=g, dtype=torch.float64).exp() * 1e-3).to(dtype),
    ])


def _close(got, expected, dtype):
    rtol, atol = TOLERANCES[dtype]
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True)


FUNCTIONS = {
    "lgamma": (ds.lgamma, torch.lgamma),
    "digamma": (ds.digamma, torch.digamma),
    **{f"polygamma_{n}": ((lambda x, n=n: ds.polygamma(n, x)), (lambda x, n=n: torch.polygamma(n, x))) for n in range(7)},
}


@pytest.mark.parametrize("name", list(FUNCTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decomposition_equals_aten(name, dtype):
    mine, eager = FUNCTIONS[name]
    x = _inputs(dtype)
    _close(mine(x), eager(x), dtype)


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_integer_inputs_promote_as_eager(name):
    mine, eager = FUNCTIONS[name]
    x = torch.arange(-5, 40)
    _close(mine(x), eager(x), torch.float32)


def test_other_dtypes_are_left_alone():
    assert ds.lgamma(torch.ones(3, dtype=torch.bfloat16)) is NotImplemented
    assert ds.digamma(torch.ones(3, dtype=torch.complex64)) is NotImplemented
    assert ds.polygamma(2, torch.ones(3, dtype=torch.float16)) is NotImplemented


def test_cot_derivative_polynomials():
    """d/dx cot(pi x) = -pi (1 + cot^2), d^2 = 2 pi^2 cot (1 + cot^2), ..."""
    assert ds._cot_derivative_polynomial(0) == [0, 1]
    assert ds._cot_derivative_polynomial(1) == [-1, 0, -1]
    assert ds._cot_derivative_polynomial(2) == [0, 2, 0, 2]
    assert ds._cot_derivative_polynomial(3) == [-2, 0, -8, 0, -6]


def _through_lort(fn, x):
    backend = LortBackend({"executor": "ort", "disk_cache": False})
    torch._dynamo.reset()
    try:
        got = torch.compile(fn, backend=backend)(x)
    finally:
        torch._dynamo.reset()
    return got, fn(x), backend


@pytest.mark.parametrize("name", ["lgamma", "digamma", "polygamma_1", "polygamma_2", "polygamma_3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_through_lort(name, dtype):
    """ORT's sin, log and pow in place of libm's: still eager's values, gradients
    (the next polygamma) too, every node in ORT."""
    eager = FUNCTIONS[name][1]
    x = _inputs(dtype)
    got, expected, backend = _through_lort(eager, x)
    _close(got, expected, dtype)
    fallbacks = [f for record in backend.records for f in record.fallbacks]
    assert not fallbacks, fallbacks
    finite = x[torch.isfinite(x) & (x.abs() < 1e6)].clone().requires_grad_()
    got, expected, backend = _through_lort(eager, finite)
    cotangent = torch.linspace(-1, 1, finite.numel(), dtype=dtype)
    g_got = torch.autograd.grad(got, finite, cotangent)[0]
    g_exp = torch.autograd.grad(expected, finite, cotangent)[0]
    _close(g_got, g_exp, dtype)
    fallbacks = [f for record in backend.records for f in record.fallbacks]
    assert not fallbacks, fallbacks


BESSEL = {
    "bessel_j0": (db.bessel_j0, torch.special.bessel_j0),
    "bessel_j1": (db.bessel_j1, torch.special.bessel_j1),
    "bessel_y0": (db.bessel_y0, torch.special.bessel_y0),
    "bessel_y1": (db.bessel_y1, torch.special.bessel_y1),
    "spherical_bessel_j0": (db.spherical_bessel_j0, torch.special.spherical_bessel_j0),
}
BESSEL_EDGES = [0.0, -0.0, 1e-6, -1e-6, 5.0, -5.0, 4.9999, 5.0001, 0.5, -0.5, 0.49999, 1e-30, 1e10, -1e10, 1e30,
                math.inf, -math.inf, math.nan]


def _bessel_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    return torch.cat([
        torch.tensor(BESSEL_EDGES, dtype=torch.float64),
        (torch.rand(3000, generator=g, dtype=torch.float64) - 0.5) * 60,
        torch.randn(500, generator=g, dtype=torch.float64) * 1e4,
    ]).to(dtype)


@pytest.mark.parametrize("name", list(BESSEL))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bessel_equals_aten(name, dtype):
    mine, eager = BESSEL[name]
    x = _bessel_inputs(dtype)
    _close(mine(x), eager(x), dtype)
    ints = torch.arange(-12, 12)
    _close(mine(ints), eager(ints), torch.float32)


@pytest.mark.parametrize("name", list(BESSEL))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bessel_through_lort(name, dtype):
    x = _bessel_inputs(dtype)
    got, expected, backend = _through_lort(BESSEL[name][1], x)
    _close(got, expected, dtype)
    fallbacks = [f for record in backend.records for f in record.fallbacks]
    assert not fallbacks, fallbacks
