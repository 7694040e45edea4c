"""Ops on dtypes ORT has no kernel for (lort.capture.decompositions.kernels) against eager
PyTorch: outputs (exact for integers), float64 gradients, inputs holding inf and NaN, and
every node in ORT."""

import math

import pytest
import torch
import torch.nn.functional as F

from lort.capture.decompositions import kernels as dk
from test_decompositions_ops import _all_in_ort, _through_lort


def _exact(got, expected):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("op", dk.FLOAT_ONLY_UNARY, ids=lambda op: op.__name__)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_float_only_unary_ops_of_integers(op, dtype):
    x = torch.tensor([-3, -1, 0, 1, 2, 5, 40]).to(dtype)
    got, expected, backend = _through_lort(lambda t: op(t), x)
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, equal_nan=True)
    _all_in_ort(backend)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.uint8])
def test_isnan_of_integers(dtype):
    x = torch.tensor([[0, 1], [3, 0]]).to(dtype)
    got, expected, backend = _through_lort(lambda t: torch.isnan(t) | (t > 1), x)
    _exact(got, expected)
    _all_in_ort(backend)


@pytest.mark.parametrize("beta,alpha", [(1, 1), (2, 3), (0, -2), (-1, 1)])
def test_int64_addmm(beta, alpha):
    g = torch.Generator().manual_seed(0)
    bias = torch.randint(-9, 10, (4,), generator=g)
    a = torch.randint(-2**20, 2**20, (4, 3), generator=g)
    b = torch.randint(-2**20, 2**20, (3, 4), generator=g)
    got, expected, backend = _through_lort(lambda c, m1, m2: torch.addmm(c, m1, m2, beta=beta, alpha=alpha), bias, a, b)
    _exact(got, expected)
    _all_in_ort(backend)


CONVS = [
    # (dims, input shape, weight shape, kwargs)
    (1, (2, 4, 9), (6, 2, 3), dict(stride=2, padding=1, groups=2)),
    (2, (1, 3, 7, 6), (4, 3, 3, 2), dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2))),
    (2, (2, 4, 5, 5), (4, 1, 3, 3), dict(groups=4)),
    (3, (1, 2, 4, 5, 4), (3, 2, 2, 3, 2), dict(stride=(1, 2, 1), padding=1)),
]
TRANSPOSED = [
    (1, (2, 4, 6), (4, 3, 3), dict(stride=2, padding=1, output_padding=1, groups=2)),
    (2, (1, 2, 4, 3), (2, 3, 3, 4), dict(stride=2, padding=1, output_padding=1)),
    (2, (1, 4, 3, 3), (4, 1, 2, 2), dict(stride=(1, 3), padding=(0, 1), dilation=(2, 1), groups=2)),
    (3, (1, 2, 2, 3, 2), (2, 2, 2, 2, 3), dict(stride=(2, 1, 2), padding=(1, 0, 1))),
]


def _conv_fn(nd, transposed, kwargs):
    name = f"conv_transpose{nd}d" if transposed else f"conv{nd}d"
    return lambda x, w, b: getattr(F, name)(x, w, b, **kwargs)


def _conv_inputs(in_shape, w_shape, transposed, groups, dtype, g):
    out_channels = w_shape[1] * groups if transposed else w_shape[0]
    if dtype.is_floating_point:
        return (torch.randn(in_shape, generator=g, dtype=dtype), torch.randn(w_shape, generator=g, dtype=dtype),
                torch.randn(out_channels, generator=g, dtype=dtype))
    return (torch.randint(-50, 50, in_shape, generator=g), torch.randint(-50, 50, w_shape, generator=g),
            torch.randint(-50, 50, (out_channels,), generator=g))


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_convolution_without_a_conv_kernel(transposed, case, dtype):
    nd, in_shape, w_shape, kwargs = (TRANSPOSED if transposed else CONVS)[case]
    g = torch.Generator().manual_seed(case)
    x, w, b = _conv_inputs(in_shape, w_shape, transposed, kwargs.get("groups", 1), dtype, g)
    fn = _conv_fn(nd, transposed, kwargs)
    got, expected, backend = _through_lort(fn, x, w, b)
    if dtype.is_floating_point:
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    else:
        _exact(got, expected)
    _all_in_ort(backend)


@pytest.mark.parametrize("transposed", [False, True])
def test_float64_convolution_gradients(transposed):
    nd, in_shape, w_shape, kwargs = (TRANSPOSED if transposed else CONVS)[1]
    g = torch.Generator().manual_seed(1)
    leaves = [t.requires_grad_() for t in _conv_inputs(in_shape, w_shape, transposed, 1, torch.float64, g)]
    fn = _conv_fn(nd, transposed, kwargs)
    got, expected, _ = _through_lort(fn, *leaves)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(got.square().sum(), leaves)
    wanted = torch.autograd.grad(expected.square().sum(), leaves)
    for a, e in zip(grads, wanted):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_transposed_convolution_never_multiplies_the_spread_zeros():
    """An infinite weight meets only the input's own elements (eager's col2im), never the
    zeros between them: NaN only where eager has one."""
    x = torch.tensor([[[1.0, 2.0, -1.0]]], dtype=torch.float64)
    w = torch.tensor([[[math.inf, 1.0, 0.5]]], dtype=torch.float64)
    got, expected, backend = _through_lort(lambda a, b: F.conv_transpose1d(a, b, stride=3, padding=1), x, w)
    assert not torch.isnan(expected).all()
    torch.testing.assert_close(got, expected, equal_nan=True)
    _all_in_ort(backend)


POOLS = [
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=(3, 2), stride=(2, 3), padding=(1, 1), ceil_mode=True),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
    dict(kernel_size=2, divisor_override=3),
]


@pytest.mark.parametrize("kwargs", POOLS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.float32])
def test_avg_pool2d_without_an_average_pool_kernel(kwargs, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, 7, 8, generator=g) * 100).to(dtype)
    got, expected, backend = _through_lort(lambda t: F.avg_pool2d(t, **kwargs), x)
    if dtype == torch.int64:
        assert (x < 0).any()  # the division rounds toward zero
        _exact(got, expected)
    else:
        torch.testing.assert_close(got, expected)
    _all_in_ort(backend)
    if dtype == torch.float32 and not kwargs.get("divisor_override"):
        names = {n.target for r in backend.records for n in r.graph_module.graph.nodes if n.op == "call_function"}
        assert torch.ops.aten.avg_pool2d.default in names  # float32 keeps ORT's AveragePool


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_avg_pool3d_and_1d(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(1, 2, 5, 4, 6, generator=g) * 100).to(dtype)

    def f(t):
        return (F.avg_pool3d(t, 2, stride=(1, 2, 2), padding=(1, 0, 1), count_include_pad=False),
                F.avg_pool1d(t[0, :, 0], 3, stride=2, ceil_mode=True))

    got, expected, backend = _through_lort(f, x)
    for a, e in zip(got, expected):
        _exact(a, e) if dtype == torch.int64 else torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    _all_in_ort(backend)


def test_avg_pool_sums_in_eagers_order():
    """Overflow-scale values cancel and absorb in the window's row-major order, as in
    eager's loop: 3e38 + 500 - 3e38 - 500 is -500 there, not 0."""
    x = torch.tensor([[[[3e38, 500.0], [-3e38, -500.0]]]], dtype=torch.float32)
    got, expected, backend = _through_lort(lambda t: F.avg_pool2d(t, 2, divisor_override=1), x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    _all_in_ort(backend)


def test_decompositions_keep_kernels_ort_has():
    x = torch.randn(1, 2, 5, 5)
    w = torch.randn(3, 2, 3, 3)
    assert dk.convolution_without_conv(x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1) is NotImplemented
    assert dk.addmm_without_gemm(torch.randn(2), torch.randn(2, 3), torch.randn(3, 2)) is NotImplemented
    assert dk.table()[torch.ops.aten.avg_pool2d.default](x, 2) is NotImplemented
    assert dk.table()[torch.ops.aten.acos.default](x) is NotImplemented
    assert dk.integer_isnan(x) is NotImplemented
