"""The error function family (lort.capture.decompositions.erf) against eager PyTorch:
each function on a grid over its whole range, tails, overflow and underflow, inf and
NaN included, in float32 and float64 (relative to the value: these functions span
hundreds of orders of magnitude), through lort with every node in ORT, and gradients."""

import math

import pytest
import torch

from lort.capture.decompositions import erf as de
from test_decompositions_ops import _all_in_ort, _through_lort

SPECIALS = [0.0, -0.0, math.inf, -math.inf, math.nan]


def _grid(lo, hi, n=4001):
    return torch.cat([torch.linspace(lo, hi, n, dtype=torch.float64), torch.tensor(SPECIALS, dtype=torch.float64)])


def _probabilities():
    tiny = torch.logspace(-300, -1, 400, dtype=torch.float64)
    return torch.cat([tiny, torch.linspace(0, 1, 2001, dtype=torch.float64), 1 - tiny[200:],
                      torch.tensor([-0.5, 1.5, math.nan], dtype=torch.float64)])


CASES = {
    "erf": (torch.erf, _grid(-8, 8)),
    "erfc": (torch.erfc, _grid(-10, 30)),
    "erfcx": (torch.special.erfcx, torch.cat([_grid(-30, 60), torch.tensor([1e5, 1e150, -1e3])])),
    "ndtri": (torch.special.ndtri, _probabilities()),
    "erfinv": (torch.erfinv, torch.cat([_grid(-1, 1), 1 - torch.logspace(-16, -1, 200, dtype=torch.float64),
                                        torch.tensor([-1.0, 1.0, 1.5, -2.0], dtype=torch.float64)])),
    "log_ndtr": (torch.special.log_ndtr, torch.cat([_grid(-60, 12), torch.tensor([-1e3, -1e10])])),
}
#: float32: eager computes in float32, so its own argument (x * x, x / sqrt(2)) is rounded
#: before exp(x^2) or erfc amplify it by about 2 x^2: 2e-5 covers |x| up to 12, where
#: these functions overflow or underflow float32 (lort computes in float64).
RTOL = {torch.float32: 2e-5, torch.float64: 1e-13}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_erf_family_through_lort(name, dtype):
    fn, x = CASES[name]
    x = x.to(dtype)
    got, expected, backend = _through_lort(fn, x)
    assert got.dtype == expected.dtype
    tiny = torch.finfo(dtype).tiny  # below it (denormals) eager's own kernels round differently
    atol = tiny * 64
    if name == "erfinv":
        # Near |y| = 1 erfinv is ill-conditioned: the last bits of erf (glibc's in eager,
        # Cephes' here) move its Newton steps by that many ulp of y times the slope
        # sqrt(pi) / 2 * exp(x^2).
        e = expected.double().nan_to_num(0.0, 0.0, 0.0)
        atol = 4 * torch.finfo(dtype).eps * math.sqrt(math.pi) / 2 * torch.exp(e * e)
        assert float(atol.median()) < 8 * torch.finfo(dtype).eps  # a few ulp away from |y| = 1
        bad = ~((got.double() - expected.double()).abs() <= atol + RTOL[dtype] * e.abs())
        bad &= ~(torch.isnan(got) & torch.isnan(expected)) & ~(got == expected)
        assert not bad.any(), (x[bad], got[bad], expected[bad])
    else:
        torch.testing.assert_close(got, expected, rtol=RTOL[dtype], atol=atol, equal_nan=True)
    _all_in_ort(backend)


@pytest.mark.parametrize("name", ["erfc", "erfinv", "ndtri", "erfcx"])
def test_erf_family_of_integers(name):
    fn, _ = CASES[name]
    x = torch.tensor([-3, -1, 0, 1, 2, 7])
    got, expected, backend = _through_lort(fn, x)
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, equal_nan=True)
    _all_in_ort(backend)


@pytest.mark.parametrize("name", ["erfc", "erfinv", "erfcx", "log_ndtr", "erf"])
def test_erf_family_gradients_in_float64(name):
    fn, _ = CASES[name]
    x = torch.tensor([-2.5, -0.7, -0.1, 0.3, 0.69, 0.95, 1.7], dtype=torch.float64)
    if name == "erfinv":
        x = x.clamp(-0.99, 0.99)
    leaf = x.clone().requires_grad_()
    got, expected, _ = _through_lort(fn, leaf)
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=0)
    (grad,) = torch.autograd.grad(got.sum(), leaf)
    (wanted,) = torch.autograd.grad(expected.sum(), leaf)
    torch.testing.assert_close(grad, wanted, rtol=1e-12, atol=0)


def test_float32_erf_keeps_orts_kernel():
    assert de.table()[torch.ops.aten.erf.default](torch.randn(3)) is NotImplemented
