"""lort's single-op decompositions (lort.capture.decompositions.ops) and translation
fixes, against eager PyTorch: the decomposition itself, and the op through lort (outputs
and gradients, float64 where it matters), with every node in ORT."""

import math

import pytest
import torch
import torch.nn.functional as F

from lort.backend import LortBackend
from lort.capture.decompositions import ops as dops

aten = torch.ops.aten

ZERO_DIM_VALUES = [2.5, -3.0, 0.0, -0.0, math.inf, -math.inf, math.nan]


def _through_lort(fn, *args):
    """fn(*args) through lort, eager's result, and the backend (its records)."""
    backend = LortBackend({"executor": "ort", "disk_cache": False})
    torch._dynamo.reset()
    try:
        got = torch.compile(fn, backend=backend)(*args)
    finally:
        torch._dynamo.reset()
    return got, fn(*args), backend


def _all_in_ort(backend) -> None:
    fallbacks = [f for record in backend.records for f in record.fallbacks]
    assert not fallbacks, fallbacks
    assert sum(record.ort_nodes for record in backend.records) > 0


@pytest.mark.parametrize("value", ZERO_DIM_VALUES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_zero_dim_reductions_equal_aten(value, dtype):
    x = torch.tensor(value, dtype=dtype)
    for op in (aten.amax.default, aten.amin.default):
        for dim in ([], [0], [-1]):
            for keepdim in (False, True):
                torch.testing.assert_close(dops.zero_dim_extremum(x, dim, keepdim), op(x, dim, keepdim), equal_nan=True)
    for op in (aten.any.dim, aten.all.dim):
        for keepdim in (False, True):
            got = dops.zero_dim_any_all(x, 0, keepdim)
            assert got.dtype == torch.bool and got.shape == torch.Size([])
            assert bool(got) == bool(op(x, 0, keepdim))
    for op in (aten.any.dims, aten.all.dims):
        assert bool(dops.zero_dim_any_all(x, [0], True)) == bool(op(x, [0], True))


@pytest.mark.parametrize("x", [torch.tensor(3), torch.tensor(0), torch.tensor(True), torch.tensor(False)])
def test_zero_dim_any_all_integers_and_bools(x):
    for op in (aten.any.dim, aten.all.dim):
        got = dops.zero_dim_any_all(x, 0, False)
        expected = op(x, 0, False)
        assert got.dtype == expected.dtype and bool(got) == bool(expected)


def test_zero_dim_decompositions_leave_other_inputs_alone():
    x = torch.randn(3, 4)
    assert dops.zero_dim_extremum(x, [0], False) is NotImplemented
    assert dops.zero_dim_any_all(x, 0, False) is NotImplemented
    assert dops.zero_dim_any_all(torch.tensor(3, dtype=torch.uint8), 0, False) is NotImplemented


@pytest.mark.parametrize("value", [2.5, -math.inf, math.nan])
def test_zero_dim_reductions_through_lort(value):
    """amax/amin/argmax/any/all on a 0-d tensor, with a dim: all in ORT (ReduceMax on a
    rank-0 input with an axis failed to build), eager's values and gradients."""

    def f(x):
        return (
            torch.amax(x, 0, keepdim=True) * 2,
            torch.amin(x, -1) + 1,
            torch.argmax(x, 0, keepdim=True),
            torch.argmin(x),
            torch.any(x, 0),
            torch.all(x, 0, keepdim=True),
        )

    x = torch.tensor(value, dtype=torch.float64, requires_grad=True)
    got, expected, backend = _through_lort(f, x)
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=0, atol=0)
    _all_in_ort(backend)
    g_got = torch.autograd.grad(got[0] + got[1], x)[0]
    g_exp = torch.autograd.grad(expected[0] + expected[1], x)[0]
    torch.testing.assert_close(g_got, g_exp, equal_nan=True, rtol=0, atol=0)


def test_zero_dim_int_amax_through_lort():
    def f(x):
        return torch.amax(x, 0), torch.amin(x, 0, keepdim=True), torch.any(x, 0), torch.all(x, 0)

    got, expected, backend = _through_lort(f, torch.tensor(-7))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    _all_in_ort(backend)


def test_outputs_that_are_not_fresh_values_get_an_identity():
    """torch_lib translates logsumexp over a 0-d tensor and repeat by no repeats to their
    input (or a constant): the group's output was then a graph input and the group failed
    ("group output 0 is not a fresh value"); now it runs in ORT with eager's values."""

    def f(x, y):
        return torch.logsumexp(x, 0), y.repeat(()), x.repeat((2,))

    x = torch.tensor(1.25, dtype=torch.float64, requires_grad=True)
    y = torch.tensor(-0.5, dtype=torch.float64)
    got, expected, backend = _through_lort(f, x, y)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    _all_in_ort(backend)
    torch.testing.assert_close(
        torch.autograd.grad(got[0] + got[2].sum(), x)[0],
        torch.autograd.grad(expected[0] + expected[2].sum(), x)[0],
        rtol=0, atol=0,
    )


def test_bool_max_min_dim_equal_aten():
    torch.manual_seed(0)
    x = torch.rand(6, 7) > 0.6
    x[2] = False
    x[3] = True
    for op in (aten.max.dim, aten.min.dim):
        for dim, keepdim in ((0, False), (1, True), (-1, False)):
            values, indices = dops.bool_max_min_dim(op)(x, dim, keepdim)
            e_values, e_indices = op(x, dim, keepdim)
            assert values.dtype == torch.bool
            torch.testing.assert_close(values, e_values, rtol=0, atol=0)
            torch.testing.assert_close(indices, e_indices, rtol=0, atol=0)
    assert dops.bool_max_min_dim(aten.max.dim)(torch.randn(3), 0) is NotImplemented


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cumprod_gradient_through_lort(dtype):
    """cumprod's backward takes max.dim of a bool mask (ArgMax takes no bool) and its
    forward decomposes to prims.prod (no translation): both now run in ORT."""

    def f(x):
        return torch.cumprod(x, 1)

    torch.manual_seed(0)
    x = torch.randn(4, 5, 3, dtype=dtype)
    x[1, 2, 0] = 0.0  # one zero: the backward's first-zero path
    x[2, 1, 1] = x[2, 3, 1] = 0.0  # two zeros
    x.requires_grad_()
    cotangent = torch.randn(4, 5, 3, dtype=dtype)
    got, expected, backend = _through_lort(f, x)
    rtol, atol = (1e-12, 1e-12) if dtype == torch.float64 else (1e-5, 1e-5)
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
    torch.testing.assert_close(
        torch.autograd.grad(got, x, cotangent)[0], torch.autograd.grad(expected, x, cotangent)[0], rtol=rtol, atol=atol
    )
    in_torch = [op for record in backend.records for op, _ in record.fallbacks]
    assert not [op for op in in_torch if op != "aten.detach.default"], in_torch


def test_prims_prod_equals_aten_prod():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    torch.testing.assert_close(dops.prims_prod(x, [0, 2]), x.prod(2).prod(0), rtol=0, atol=0)
    torch.testing.assert_close(dops.prims_prod(x, [-1]), x.prod(-1), rtol=0, atol=0)
    torch.testing.assert_close(dops.prims_prod(x, []), x, rtol=0, atol=0)
    ints = torch.randint(-3, 4, (4, 5))
    got = dops.prims_prod(ints, [1], output_dtype=torch.float64)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, ints.prod(1).double(), rtol=0, atol=0)


def test_integer_rounding_and_angle_through_lort():
    def f(x, b):
        return torch.trunc(x), torch.floor(x), torch.ceil(x), torch.round(x), torch.angle(x), torch.angle(b)

    x = torch.tensor([-5, -1, 0, 3, 2**40])
    b = torch.tensor([True, False])
    got, expected, backend = _through_lort(f, x, b)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    _all_in_ort(backend)
    assert dops.integer_rounding(torch.randn(2)) is NotImplemented
    assert dops.integer_angle(torch.randn(2)) is NotImplemented


def test_hardtanh_backward_equals_aten():
    x = torch.tensor([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0, math.nan, math.inf, -math.inf], dtype=torch.float64)
    g = torch.arange(1.0, 11.0, dtype=torch.float64)
    for lo, hi in ((-1.0, 1.0), (0.0, 6.0), (-0.5, 0.5)):
        torch.testing.assert_close(
            dops.hardtanh_backward(g, x, lo, hi), aten.hardtanh_backward(g, x, lo, hi), rtol=0, atol=0
        )


@pytest.mark.parametrize("fn", [torch.nn.functional.hardtanh, torch.nn.functional.relu6])
def test_hardtanh_float64_gradient_through_lort(fn):
    x = torch.tensor([-7.0, -1.0, -0.25, 0.0, 0.75, 1.0, 5.0, 6.0, 9.0], dtype=torch.float64, requires_grad=True)
    cotangent = torch.linspace(-1, 1, 9, dtype=torch.float64)
    got, expected, backend = _through_lort(fn, x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(
        torch.autograd.grad(got, x, cotangent)[0], torch.autograd.grad(expected, x, cotangent)[0], rtol=0, atol=0
    )
    _all_in_ort(backend)


def test_float64_layer_norm_through_lort():
    """float64 layer norm (outputs, mean and rstd, gradients of input, weight and bias) in
    ORT: torch_lib's LayerNormalization gave float32 mean/rstd and the group failed."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)

    def f(x, w, b):
        return torch.native_layer_norm(x, [4, 6], w, b, 2.0**-17)  # float32-exact eps: stays in ORT

    got, expected, backend = _through_lort(f, x, w, b)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype == torch.float64
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    _all_in_ort(backend)
    cotangent = torch.randn(3, 4, 6, dtype=torch.float64)
    for g, e in zip(torch.autograd.grad(got[0], (x, w, b), cotangent), torch.autograd.grad(expected[0], (x, w, b), cotangent)):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    assert dops.float64_native_layer_norm(x.float(), [4, 6], None, None, 1e-5) is NotImplemented


def test_scalars_of_promotion_are_exact_through_lort():
    """Type promotion makes ``x * 0.1`` ``mul(x, scalar_tensor(0.1, dtype))``; torch_lib
    wrote a float scalar_tensor as a float32 constant cast to the dtype (0.1 off by
    1.5e-9 in float64). lort's scalar_tensor is exact in every dtype (int64 checked too)."""

    def f(x, n):
        return x * 0.1 + 1e-300, x.clamp(-0.3, 0.7), n + (2**60 + 1), n * 3

    x = torch.linspace(-2, 2, 11, dtype=torch.float64)
    n = torch.arange(-3, 4)
    got, expected, backend = _through_lort(f, x, n)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    _all_in_ort(backend)
    xf = x.float()
    got, expected, backend = _through_lort(f, xf, n)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_float64_leaky_relu_is_exact():
    """The slope, 0.01 by default, is an ONNX float32 attribute in torch_lib's
    translation (0.0099999998 * x in ORT); float64 leaky_relu and its backward are
    PyTorch's decompositions, the slope an exact float64 scalar."""
    x = torch.tensor([-3.0, -1e-9, 2.0, -0.0], dtype=torch.float64)
    for f in (F.leaky_relu, lambda v: F.leaky_relu(v, 0.3)):
        leaf = x.clone().requires_grad_()
        got, expected, backend = _through_lort(f, leaf)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        (grad,) = torch.autograd.grad(got.sum(), leaf)
        (wanted,) = torch.autograd.grad(expected.sum(), leaf)
        torch.testing.assert_close(grad, wanted, rtol=0, atol=0)
        _all_in_ort(backend)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_integer_pixel_shuffle_through_lort(dtype):
    x = torch.arange(2 * 8 * 3 * 2).reshape(2, 8, 3, 2)
    x = x.to(dtype) if dtype != torch.bool else x % 3 == 0
    got, expected, backend = _through_lort(lambda t: torch.nn.functional.pixel_shuffle(t, 2), x)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    _all_in_ort(backend)
    assert dops.integer_pixel_shuffle(torch.randn(1, 4, 2, 2), 2) is NotImplemented


def test_symbolic_scalar_tensor_under_dynamic_shapes():
    """Under dynamic shapes scalar_tensor takes a size (a graph value), which lort's exact
    scalar_tensor casts as torch_lib does: the whole graph stays in ORT."""

    def f(x):
        return x * (x.shape[0] * 0.1) + x.shape[1]

    backend = LortBackend({"executor": "ort", "disk_cache": False})
    torch._dynamo.reset()
    try:
        compiled = torch.compile(f, backend=backend, dynamic=True)
        for n in (3, 5):
            x = torch.randn(n, n + 1, dtype=torch.float64)
            torch.testing.assert_close(compiled(x), f(x), rtol=0, atol=0)
    finally:
        torch._dynamo.reset()
    _all_in_ort(backend)


@pytest.mark.parametrize("fn", [torch.isinf, torch.isposinf, torch.isneginf, torch.isfinite], ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_infinity_checks_in_the_input_dtype(fn, dtype):
    """torch_lib's isinf casts to float32 first: a float64 1e300 came out infinite."""
    big = torch.finfo(dtype).max
    x = torch.tensor([big, -big, math.inf, -math.inf, 1.0, -0.0, math.nan], dtype=dtype)
    if dtype == torch.float64:
        x = torch.cat([x, torch.tensor([1e300, -1e300, 3.5e38], dtype=dtype)])
    got, expected, backend = _through_lort(fn, x)
    assert torch.equal(got, expected), (got, expected)
    _all_in_ort(backend)


@pytest.mark.parametrize("fn", [torch.logaddexp, torch.logaddexp2], ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_logaddexp_does_not_overflow(fn, dtype):
    """torch_lib's logaddexp is log(exp(a) + exp(b)): inf from a ~ 89 in float32 (the
    known-wrong table sends it to PyTorch's decomposition, max + log1p(exp(-|a - b|)))."""
    a = torch.tensor([500.0, -800.0, 1.0, math.inf, -math.inf, math.inf, math.nan, 80.0, 3e38], dtype=dtype)
    b = torch.tensor([499.0, -800.0, -2.0, math.inf, -math.inf, -math.inf, 1.0, 100.0, 3e38], dtype=dtype)
    if dtype == torch.float64:
        a, b = torch.cat([a, a.new_tensor([1e300])]), torch.cat([b, b.new_tensor([1e300])])
    got, expected, backend = _through_lort(fn, a, b)
    torch.testing.assert_close(got, expected, equal_nan=True)
    _all_in_ort(backend)
    x, y = (t[:3].clone().requires_grad_() for t in (a, b))
    (gx, gy), (ex, ey) = (torch.autograd.grad(f(x, y).sum(), (x, y)) for f in (torch.compile(fn, backend="lort"), fn))
    torch.testing.assert_close((gx, gy), (ex, ey))


NAN_INF_ROWS = [[1.0, math.nan, 2.0], [1.0, math.inf, 2.0], [math.inf, -math.inf], [-math.inf, -math.inf],
                [1.0, 2.0, math.nan, math.inf], [3.0, -1.0, 0.5]]


@pytest.mark.parametrize(
    "fn",
    [
        lambda t: torch.log_softmax(t, 0),
        lambda t: torch.softmax(t, 0),
        lambda t: torch.logsumexp(t, 0),
    ],
    ids=["log_softmax", "softmax", "logsumexp"],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("row", NAN_INF_ROWS, ids=lambda r: ",".join(map(str, r)))
def test_softmax_family_on_nan_and_inf(fn, dtype, row):
    """ORT's float64 LogSoftmax gave log_softmax([1, nan, 2]) = [45.05, nan, 46.05] and
    torch_lib's logsumexp gave inf for [1, 2, nan, inf] (PyTorch: NaN in both)."""
    got, expected, backend = _through_lort(fn, torch.tensor(row, dtype=dtype))
    torch.testing.assert_close(got, expected, equal_nan=True)
    _all_in_ort(backend)


@pytest.mark.parametrize("exponent", [0.5, -0.5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_square_root_powers_as_pytorch(exponent, dtype):
    """pow(x, +-0.5) is sqrt/rsqrt in PyTorch: NaN at -inf and -0.0 at -0.0 (C's pow gives
    inf and 0.0)."""
    x = torch.tensor([-math.inf, -0.0, 0.0, 4.0, -1.0, math.inf, math.nan], dtype=dtype)
    got, expected, backend = _through_lort(lambda t: torch.pow(t, exponent), x)
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=0, atol=0)
    numbers = ~torch.isnan(expected)  # the sign of a NaN means nothing
    assert torch.equal(torch.signbit(got[numbers]), torch.signbit(expected[numbers]))
    _all_in_ort(backend)


def test_heaviside_of_nan_is_zero():
    x = torch.tensor([-1.0, 0.0, 2.0, math.nan, -math.inf])
    got, expected, backend = _through_lort(lambda t: torch.heaviside(t, torch.tensor(0.5)), x)
    assert torch.equal(got, expected), (got, expected)
    _all_in_ort(backend)


def test_xlogy_of_zero_and_nan_is_nan():
    x = torch.tensor([0.0, -0.0, 1.0, 0.0, 2.0, 0.0])
    y = torch.tensor([math.nan, math.nan, math.nan, -1.0, 0.0, math.inf])
    got, expected, backend = _through_lort(torch.xlogy, x, y)
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=0, atol=0)
    _all_in_ort(backend)


@pytest.mark.parametrize(
    "a_shape, b_shape, transpose_a",
    [
        ((4, 3, 5), (5, 6), True),  # a transposed batch (nn.MultiheadAttention, batch_first)
        ((2, 4, 3, 5), (5, 6), False),
        ((4, 3, 5), (5, 6), False),
        ((3, 5), (5, 6), False),  # PyTorch's decomposition from here on
        ((5,), (5, 6), False),
        ((4, 3, 5), (5,), False),
        ((5, 3), (4, 3, 2), False),
    ],
)
def test_matmul_folded_equals_aten(a_shape, b_shape, transpose_a):
    a = torch.randn(*a_shape, dtype=torch.float64)
    if transpose_a:
        a = a.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, non-contiguous
        assert not a.is_contiguous()
    b = torch.randn(*b_shape, dtype=torch.float64)
    torch.testing.assert_close(dops.matmul_folded(a, b), torch.matmul(a, b), rtol=1e-12, atol=1e-12)


def test_exported_matmul_of_a_transposed_batch_is_one_matrix_product():
    """Under torch.export without grad PyTorch's decomposition broadcasts the matrix to a
    batch (expand + bmm), which ORT ran as one product per batch over a copied weight."""
    from lort.capture import decompositions

    class Project(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(6, 5))

        def forward(self, x):
            return torch.matmul(x.transpose(0, 1), self.w.t())

    model, x = Project(), torch.randn(3, 4, 5)
    with torch.no_grad():
        ep = torch.export.export(model, (x,), strict=False).run_decompositions(decompositions.table())
        targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
        assert aten.bmm.default not in targets and aten.mm.default in targets, targets
        torch.testing.assert_close(ep.module()(x), model(x))
