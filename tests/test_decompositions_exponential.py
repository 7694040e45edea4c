"""expm1, elu/celu/selu, sigmoid, silu and softplus (lort.capture.decompositions_exponential)
against eager PyTorch in relative terms, down to values near zero where ORT's kernels and
torch_lib's ``exp(x) - 1`` lost every digit (an absolute tolerance hides that: expm1(1e-10)
was 0); through lort with every node in ORT; gradients in float64.

The budget is 4 ulp of the expected value: both sides round a few times (eager's vectorized
exp and expm1 are within 1-2 ulp, Kahan's form adds its division and product); measured at
most 2.5 ulp over the grids below (8 for gradients, PyTorch's formulas over these values)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from lort.capture import decompositions
from lort.capture import decompositions_exponential as dx
from test_decompositions_ops import _all_in_ort, _through_lort

aten = torch.ops.aten

FUNCTIONS = {
    "expm1": torch.expm1,
    "elu": F.elu,
    "elu_scaled": lambda x: torch.ops.aten.elu(x, 0.7, 1.3, 0.4),
    "selu": F.selu,
    "celu": lambda x: F.celu(x, 0.3),
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "glu": lambda x: F.glu(torch.stack([x.flip(0), x]), 0),
}


def _grid(dtype):
    lim = 88.0 if dtype == torch.float32 else 709.0
    tiny = -40 if dtype == torch.float32 else -300
    smalls = torch.logspace(tiny, 0, 1001, dtype=dtype)
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45 if dtype == torch.float32 else 5e-324,
                             -800.0, 800.0, 88.7, -103.0, 709.9, -745.2], dtype=dtype)
    return torch.cat([torch.linspace(-lim, lim, 4001, dtype=dtype), smalls, -smalls, specials])


def _relative(got, expected, ulps=4):
    """``got`` within ``ulps`` of ``expected`` relative to its own size (below the smallest
    normal, an ulp is the smallest subnormal: eager's vectorized exp flushes some
    subnormal results to 0 that ORT's keeps); NaN where it is NaN, infinities exactly, and
    zeros of the same sign where both are zero."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    info = torch.finfo(expected.dtype)
    finite = torch.isfinite(expected)
    e = expected[finite]
    ulp = info.eps * e.abs().clamp_min(info.tiny)
    err = (got[finite] - e).abs() / ulp
    assert err.max() <= ulps, f"{err.max():.1f} ulp at {e[err.argmax()].item()!r}: {got[finite][err.argmax()].item()!r}"
    torch.testing.assert_close(got[~finite], expected[~finite], rtol=0, atol=0, equal_nan=True)
    zero = (expected == 0) & (got == 0)
    assert torch.equal(torch.signbit(got[zero]), torch.signbit(expected[zero])), "a zero of the wrong sign"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_accurate_near_zero_and_everywhere(name, dtype):
    x = _grid(dtype)
    got, expected, backend = _through_lort(FUNCTIONS[name], x)
    _relative(got, expected)
    _all_in_ort(backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_small_values_that_were_wrong(dtype):
    x = torch.tensor([1e-30, 1e-10, 1e-5, -1e-5, -17.26, -100.0], dtype=dtype)
    got, expected, _ = _through_lort(lambda v: (torch.expm1(v[:4]), F.elu(-v[:4]), torch.sigmoid(v[4:])), x)
    assert got[0][0] == x[0]  # expm1(1e-30) is 1e-30, not exp(1e-30) - 1 = 0
    for g, e in zip(got, expected):
        _relative(g, e)


def test_float64_softplus_and_mish_are_accurate():
    """ORT has no float64 Softplus kernel; what ran instead gave softplus(-100) = 0, and
    mish(-40) = -0 (eager -1.7e-16)."""
    x = torch.cat([torch.linspace(-800, 800, 4001, dtype=torch.float64), -torch.logspace(-300, 3, 401, dtype=torch.float64),
                   torch.tensor([-100.0], dtype=torch.float64)])
    got, expected, backend = _through_lort(lambda v: (F.softplus(v), F.softplus(v, 2.0, 15.0), F.mish(v)), x)
    for g, e in zip(got[:2], expected[:2]):
        _relative(g, e)
    # Below x = -700, exp(x) is subnormal, and mish multiplies it by |x| ~ 700: eager's
    # vectorized exp flushes it (mish(-740) = -0.0), ORT's keeps it (-3.7e-321).
    normal = x > -700
    _relative(got[2][normal], expected[2][normal])
    assert float(got[0][-1]) == pytest.approx(math.exp(-100.0), rel=1e-15)  # it was 0
    _all_in_ort(backend)


@pytest.mark.parametrize("name", ["expm1", "elu_scaled", "selu", "celu", "sigmoid", "silu", "glu", "softplus", "mish"])
def test_gradients_in_float64(name):
    fn = FUNCTIONS.get(name, {"softplus": lambda v: F.softplus(v, 2.0, 3.0), "mish": F.mish}.get(name))
    x = torch.tensor([-40.0, -3.0, -0.7, -1e-9, 0.3, 1.6, 25.0], dtype=torch.float64)
    leaf = x.clone().requires_grad_()
    got, expected, backend = _through_lort(fn, leaf)
    _relative(got.detach(), expected.detach())
    (grad,) = torch.autograd.grad(got.sum(), leaf)
    (wanted,) = torch.autograd.grad(expected.sum(), leaf)
    _relative(grad, wanted, ulps=8)
    _all_in_ort(backend)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_float16_is_computed_in_float32(name):
    """Eager computes float16 in float32 and rounds once; so do the decompositions, run
    here op by op in eager PyTorch, as a provider with float16 kernels (CUDA) would run
    them: in float16, exp(11.5) is inf and sigmoid(-11.5) was 0 (eager 1.0e-5). Through
    lort on CPU, ORT itself computes float16 nodes in float32."""
    x = torch.cat([torch.linspace(-12, 12, 961), torch.tensor([-11.5, -1e-4, 3e-5, -0.0])]).half()
    fn = FUNCTIONS[name]
    traced = make_fx(lambda v: fn(v), decomposition_table=decompositions.table())(x)
    assert not any(n.target in (aten.sigmoid.default, aten.expm1.default, aten.elu.default, aten.selu.default,
                                aten.celu.default, aten.silu.default, aten.glu.default) for n in traced.graph.nodes)
    _relative(traced(x), fn(x), ulps=1)
    got, expected, backend = _through_lort(fn, x)
    _relative(got, expected, ulps=1)
    _all_in_ort(backend)


def test_which_inputs_are_decomposed():
    table = dx.table()
    ints = torch.tensor([1, 2])
    assert table[torch.ops.aten.expm1.default](ints) is NotImplemented
    assert table[torch.ops.aten.elu.default](ints) is NotImplemented
    # float32 on CPU keeps ORT's Softplus kernel (accurate); other devices (meta stands in
    # for CUDA, whose Softplus is log(exp(x) + 1)) get eager's formula, as sigmoid does.
    assert table[torch.ops.aten.softplus.default](torch.ones(2)) is NotImplemented
    assert table[torch.ops.aten.softplus.default](torch.ones(2, device="meta")) is not NotImplemented
    assert table[torch.ops.aten.sigmoid.default](torch.ones(2, device="meta")) is not NotImplemented
