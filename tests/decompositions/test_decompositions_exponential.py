"""expm1, elu/celu/selu, sigmoid, silu, glu and softplus against eager PyTorch, through lort
with every node in ORT (lort.capture.decompositions.exponential, README "Precision").

Two kinds of guarantee, as the precision policy says:

* where lort keeps ORT's kernel (on CPU: Sigmoid, x * Sigmoid(x) which ORT fuses into
  QuickGelu, Elu, Celu, Selu, float32 Softplus), the test is the tolerance that justifies
  it: ``torch.testing.assert_close``'s defaults for the dtype over the whole range, from
  the smallest values to overflow, NaN/inf exactly, no sign flipped, for outputs and
  float64 gradients;
* where lort decomposes for accuracy (expm1 everywhere; float64 softplus and mish, which
  ORT's kernel would overflow or flush; the formulas used off CPU), the test is the
  accuracy it buys: within 4 ulp of eager relative to the value's own size (both sides
  round a few times; measured at most 2.5 ulp, 8 for gradients).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from lort.capture import decompositions
from lort.capture.decompositions import exponential as dx
from test_decompositions_ops import _all_in_ort, _through_lort

aten = torch.ops.aten

#: Through ORT's own kernel on CPU (float32, float16), within the tolerance (glu and
#: elu with an input_scale through eager's formulas).
KERNELS = {
    "elu": F.elu,
    "elu_scaled": lambda x: torch.ops.aten.elu(x, 0.7, 1.3, 0.4),
    "selu": F.selu,
    "celu": lambda x: F.celu(x, 0.3),
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "glu": lambda x: F.glu(torch.stack([x.flip(0), x]), 0),
}
FUNCTIONS = {"expm1": torch.expm1, **KERNELS}


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


def _within_tolerance(got, expected):
    """assert_close's default tolerances for the dtype (NaN where eager's is NaN), and
    no nonzero value of the other sign than eager's."""
    torch.testing.assert_close(got, expected, equal_nan=True)
    flipped = (torch.sign(got) * torch.sign(expected)) < 0
    assert not flipped.any(), f"sign flipped at {expected[flipped][:4]}"


@pytest.mark.parametrize(
    "name,dtype",
    [(name, torch.float64) for name in sorted(FUNCTIONS)]
    + [(name, torch.float32) for name in ("expm1", "glu", "elu_scaled")],
)
def test_accurate_near_zero_and_everywhere(name, dtype):
    """Within 4 ulp where lort decomposes: expm1 on every dtype, the others in float64
    (eager's formulas), glu and elu with an input_scale in float32 too."""
    x = _grid(dtype)
    got, expected, backend = _through_lort(FUNCTIONS[name], x)
    _relative(got, expected)
    _all_in_ort(backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_orts_kernels_are_within_the_tolerance_everywhere(name, dtype):
    """The tolerance that justifies ORT's kernels on CPU: over the whole range, at
    values near zero (where MLAS's logistic is accurate in absolute terms only: float32
    sigmoid(-17.26) is 3.7 times eager's 3.2e-8) and at the extremes."""
    x = _grid(dtype if dtype != torch.float16 else torch.float32)
    x = x if dtype != torch.float16 else x.clamp(-65000, 65000).half()
    got, expected, backend = _through_lort(KERNELS[name], x)
    _within_tolerance(got, expected)
    if dtype != torch.float16:  # ORT's CPU provider runs some float16 nodes in PyTorch
        _all_in_ort(backend)


def test_sigmoid_and_silu_are_ort_kernels_on_cpu():
    """What the tolerance buys: one Sigmoid per sigmoid, x * Sigmoid(x) per SiLU (ORT
    fuses it into QuickGelu), where eager's formula was four nodes each."""
    x = torch.randn(64)
    _, _, backend = _through_lort(lambda v: (torch.sigmoid(v), F.silu(v)), x)
    ops = [n.target for r in backend.records for n in r.graph_module.graph.nodes if n.op == "call_function"]
    assert ops.count(aten.sigmoid.default) == 1 and ops.count(aten.silu.default) == 1, ops
    assert aten.exp.default not in ops


def test_what_the_accurate_expm1_protects():
    """expm1 within atol is not enough: what users build on it turns exp(x) - 1's lost
    digits into values far outside any tolerance (log(expm1(1e-10)) was -inf)."""
    x = torch.tensor([1e-30, 1e-10, 1e-7, 1e-5, -1e-5], dtype=torch.float32)
    got, expected, _ = _through_lort(lambda v: (torch.expm1(v), torch.log(torch.expm1(v[:4])), v / torch.expm1(v)), x)
    assert got[0][0] == x[0]  # expm1(1e-30) is 1e-30, not exp(1e-30) - 1 = 0
    for g, e in zip(got, expected):
        _relative(g, e)
    naive = torch.log(torch.exp(x[:4]) - 1)
    assert torch.isinf(naive[:2]).all()  # the translation lort replaces


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
    (grad,) = torch.autograd.grad(got.sum(), leaf)
    (wanted,) = torch.autograd.grad(expected.sum(), leaf)
    _relative(got.detach(), expected.detach())
    _relative(grad, wanted, ulps=8)
    _all_in_ort(backend)


@pytest.mark.parametrize("name", ["elu", "selu", "celu", "sigmoid", "silu"])
def test_float32_gradients_of_orts_kernels_are_within_the_tolerance(name):
    """Against float64 eager: lort's float32 gradient (ORT's kernels forward, their
    PyTorch formulas backward over ORT's Sigmoid) no further from it than the tolerance
    allows, over the range where the gradient is not flushed to zero."""
    fn = FUNCTIONS[name]
    x = torch.cat([torch.linspace(-60, 60, 2401), -torch.logspace(-30, 1, 301), torch.logspace(-30, 1, 301)])
    leaf = x.clone().requires_grad_()
    got, _, backend = _through_lort(fn, leaf)
    (grad,) = torch.autograd.grad(got.sum(), leaf)
    ref = x.double().requires_grad_()
    (wanted,) = torch.autograd.grad(fn(ref).sum(), ref)
    _within_tolerance(grad, wanted.float())
    _all_in_ort(backend)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_float16_is_computed_in_float32(name):
    """Eager computes float16 in float32 and rounds once; so do the decompositions used
    off CPU, traced here for a device other than CPU (meta) and run op by op in eager
    PyTorch, as a provider with float16 kernels (CUDA) would run them: in float16,
    exp(11.5) is inf and sigmoid(-11.5) was 0 (eager 1.0e-5)."""
    x = torch.cat([torch.linspace(-12, 12, 961), torch.tensor([-11.5, -1e-4, 3e-5, -0.0])]).half()
    fn = FUNCTIONS[name]
    traced = make_fx(lambda v: fn(v), decomposition_table=decompositions.table())(x.to("meta"))
    assert not any(n.target in (aten.sigmoid.default, aten.expm1.default, aten.elu.default, aten.selu.default,
                                aten.celu.default, aten.silu.default, aten.glu.default) for n in traced.graph.nodes)
    _relative(traced(x), fn(x), ulps=1)


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
    # On CPU, ORT's kernels (within the tolerance); expm1 is decomposed everywhere.
    for op in (aten.sigmoid, aten.silu, aten.elu, aten.celu, aten.selu):
        assert table[op.default](torch.ones(2)) is NotImplemented, op
        assert table[op.default](torch.ones(2, dtype=torch.float64)) is not NotImplemented, op
    assert table[aten.elu.default](torch.ones(2), 1.0, 1.0, 0.5) is not NotImplemented  # torch_lib's is wrong
    assert table[aten.expm1.default](torch.ones(2)) is not NotImplemented
    assert table[aten.glu.default](torch.ones(2)) is not NotImplemented
