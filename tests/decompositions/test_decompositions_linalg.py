"""lort's linalg_solve_triangular, triangular_solve and lu_unpack
(lort.capture.decompositions.linalg) against eager PyTorch: every (upper, left or
transpose, unitriangular), batch broadcasting, the unread triangle holding NaN, the
pivots' permutation, and the ops through lort (values and gradients) with every node in
ORT."""

import itertools
import math

import pytest
import torch

from lort.backend import LortBackend
from lort.capture.decompositions import linalg as dl

SHAPES = [((3, 3), (3, 2)), ((1, 1), (1, 4)), ((2, 4, 4), (4, 3)), ((4, 4), (2, 4, 1)), ((2, 1, 5, 5), (3, 5, 2))]
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12)}


def _system(a_shape, b_shape, dtype, upper, left, generator):
    n = a_shape[-1]
    a = torch.randn(a_shape, dtype=dtype, generator=generator) + 3 * torch.eye(n, dtype=dtype)
    unread = torch.ones(n, n, dtype=torch.bool).tril(-1) if upper else torch.ones(n, n, dtype=torch.bool).triu(1)
    a = a.masked_fill(unread, math.nan)  # LAPACK reads one triangle only
    b = torch.randn(b_shape, dtype=dtype, generator=generator)
    return a, (b if left else b.transpose(-2, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_solve_triangular_equals_aten(dtype):
    g = torch.Generator().manual_seed(0)
    rtol, atol = TOLERANCES[dtype]
    for (a_shape, b_shape), upper, left, unit in itertools.product(SHAPES, (False, True), (False, True), (False, True)):
        a, b = _system(a_shape, b_shape, dtype, upper, left, g)
        kwargs = dict(upper=upper, left=left, unitriangular=unit)
        expected = torch.linalg.solve_triangular(a, b, **kwargs)
        got = dl.linalg_solve_triangular(a, b, **kwargs)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


def test_large_complex_and_empty_systems_are_left_alone():
    n = dl.MAX_SIZE + 1
    assert dl.linalg_solve_triangular(torch.eye(n), torch.ones(n, 1), upper=True) is NotImplemented
    c = torch.eye(2, dtype=torch.complex64)
    assert dl.linalg_solve_triangular(c, c, upper=False) is NotImplemented
    assert dl.linalg_solve_triangular(torch.eye(2), torch.ones(2, 0), upper=False) is NotImplemented


@pytest.mark.parametrize("upper, left", [(False, True), (True, False)])
def test_solve_triangular_through_lort(upper, left):
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(2, 4, 4, dtype=torch.float64, generator=g) + 3 * torch.eye(4, dtype=torch.float64))
    a = (a.triu() if upper else a.tril()).requires_grad_()
    b = torch.randn(2, 4, 3, dtype=torch.float64, generator=g)
    b = (b if left else b.transpose(-2, -1)).contiguous().requires_grad_()

    def f(a, b):
        return torch.linalg.solve_triangular(a, b, upper=upper, left=left) * 2

    backend = LortBackend({"executor": "ort", "disk_cache": False})
    torch._dynamo.reset()
    try:
        got = torch.compile(f, backend=backend)(a, b)
    finally:
        torch._dynamo.reset()
    expected = f(a, b)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    cotangent = torch.randn(expected.shape, dtype=torch.float64, generator=g)
    for x, y in zip(torch.autograd.grad(got, (a, b), cotangent), torch.autograd.grad(expected, (a, b), cotangent)):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    fallbacks = [f for record in backend.records for f in record.fallbacks]
    assert not [op for op, _ in fallbacks if op != "aten.detach.default"], fallbacks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_triangular_solve_equals_aten(dtype):
    g = torch.Generator().manual_seed(2)
    rtol, atol = TOLERANCES[dtype]
    for (a_shape, b_shape), upper, transpose, unit in itertools.product(
        SHAPES, (False, True), (False, True), (False, True)
    ):
        a = torch.randn(a_shape, dtype=dtype, generator=g) + 3 * torch.eye(a_shape[-1], dtype=dtype)
        b = torch.randn(b_shape, dtype=dtype, generator=g)
        expected = torch.triangular_solve(b, a, upper=upper, transpose=transpose, unitriangular=unit)
        got = dl.triangular_solve(b, a, upper, transpose, unit)
        for x, y in zip(got, expected):
            assert x.shape == y.shape
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lu_unpack_equals_aten(dtype):
    g = torch.Generator().manual_seed(3)
    for shape in [(4, 3), (3, 4), (3, 3), (2, 5, 5), (2, 3, 4, 2), (1, 1)]:
        lu, pivots = torch.linalg.lu_factor(torch.randn(shape, dtype=dtype, generator=g))
        for x, y in zip(dl.lu_unpack(lu, pivots), torch.lu_unpack(lu, pivots)):
            assert x.shape == y.shape and x.dtype == y.dtype
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    lu, pivots = torch.linalg.lu_factor(torch.randn(3, 3))
    assert dl.lu_unpack(lu, pivots, unpack_data=False) is NotImplemented


def test_lu_unpack_through_lort():
    g = torch.Generator().manual_seed(4)
    lu, pivots = torch.linalg.lu_factor(torch.randn(2, 4, 3, dtype=torch.float64, generator=g))
    lu.requires_grad_()
    backend = LortBackend({"executor": "ort", "disk_cache": False})
    torch._dynamo.reset()
    try:
        got = torch.compile(torch.lu_unpack, backend=backend)(lu, pivots)
    finally:
        torch._dynamo.reset()
    expected = torch.lu_unpack(lu, pivots)
    for x, y in zip(got, expected):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    fallbacks = [f for record in backend.records for f in record.fallbacks]
    assert not [op for op, _ in fallbacks if op != "aten.detach.default"], fallbacks
    cotangents = [torch.randn(t.shape, dtype=t.dtype, generator=g) for t in expected[1:]]
    g_got = torch.autograd.grad(got[1:], lu, cotangents)[0]
    g_exp = torch.autograd.grad(expected[1:], lu, cotangents)[0]
    torch.testing.assert_close(g_got, g_exp, rtol=0, atol=0)


LU_SOLVE_CASES = [((3, 3), (3, 2)), ((2, 4, 4), (2, 4, 3)), ((4, 4), (2, 4, 1)), ((2, 1, 3, 3), (4, 3, 3))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("left", [True, False], ids=["left", "right"])
@pytest.mark.parametrize("adjoint", [False, True], ids=["plain", "adjoint"])
def test_lu_solve_equals_aten(dtype, left, adjoint):
    g = torch.Generator().manual_seed(5)
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    for shape_a, shape_b in LU_SOLVE_CASES:
        lu, pivots = torch.linalg.lu_factor(torch.randn(shape_a, dtype=dtype, generator=g))
        b = torch.randn(shape_b, dtype=dtype, generator=g)
        if not left:
            b = b.transpose(-2, -1).contiguous()
        expected = torch.linalg.lu_solve(lu, pivots, b, left=left, adjoint=adjoint)
        got = dl.linalg_lu_solve(lu, pivots, b, left=left, adjoint=adjoint)
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    # inf in B stays inf where eager's row swaps move it (a product with P would give NaN)
    lu, pivots = torch.linalg.lu_factor(torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=dtype))
    b = torch.tensor([[1.0], [float("inf")]], dtype=dtype)
    b = b if left else b.transpose(-2, -1).contiguous()
    torch.testing.assert_close(dl.linalg_lu_solve(lu, pivots, b, left=left, adjoint=adjoint),
                               torch.linalg.lu_solve(lu, pivots, b, left=left, adjoint=adjoint), equal_nan=True)


def test_lu_solve_leaves_what_it_cannot_solve():
    lu, pivots = torch.linalg.lu_factor(torch.randn(3, 3))
    assert dl.linalg_lu_solve(lu, pivots, torch.ones(3, 1, dtype=torch.float64)) is NotImplemented  # mixed dtypes
    lu, pivots = torch.linalg.lu_factor(torch.randn(dl.MAX_SIZE + 1, dl.MAX_SIZE + 1))
    assert dl.linalg_lu_solve(lu, pivots, torch.ones(dl.MAX_SIZE + 1, 1)) is NotImplemented


def test_lu_solve_through_lort():
    g = torch.Generator().manual_seed(6)
    lu, pivots = torch.linalg.lu_factor(torch.randn(2, 4, 4, dtype=torch.float64, generator=g))
    b = torch.randn(2, 4, 3, dtype=torch.float64, generator=g, requires_grad=True)
    backend = LortBackend({"executor": "ort", "disk_cache": False})

    def fn(lu, pivots, b):
        return torch.linalg.lu_solve(lu, pivots, b) + torch.linalg.lu_solve(lu, pivots, b, adjoint=True)

    torch._dynamo.reset()
    try:
        got = torch.compile(fn, backend=backend)(lu, pivots, b)
    finally:
        torch._dynamo.reset()
    expected = fn(lu, pivots, b)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    fallbacks = [f for record in backend.records for f in record.fallbacks]
    assert not [op for op, _ in fallbacks if op != "aten.detach.default"], fallbacks
    assert sum(r.ort_nodes for r in backend.records) > 0
    cotangent = torch.randn(expected.shape, dtype=expected.dtype, generator=g)
    torch.testing.assert_close(torch.autograd.grad(got, b, cotangent)[0],
                               torch.autograd.grad(expected, b, cotangent)[0], rtol=1e-12, atol=1e-12)
