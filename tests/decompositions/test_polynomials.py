"""lort's translations of the orthogonal polynomials (lort.translate.polynomials) against
eager PyTorch on the CPU: Chebyshev T, U, V, W and their shifted forms, Hermite H and He,
Laguerre L and Legendre P, through lort with every node in ORT. x over a dense range
and the kernels' edges (±1, 0, the floats next to them, ±inf, NaN), n over -2..20 and
100, 200, 600, a fraction, NaN and ±inf (n is cast to int64 as the kernel casts it),
broadcast against each other; integer inputs, Python scalars and 0-d tensors promote as
eager does."""

import math
import time

import pytest
import torch
import torch.fx
from test_decompositions_special import _through_lort

from lort.reasons import ReasonKind
from lort.translate import polynomials

S = torch.special
OPS = [
    "chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v", "chebyshev_polynomial_w",
    "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
    "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
    "legendre_polynomial_p",
]
#: Kernels that return an uninitialized variable when a NaN x enters their recurrence
#: (eager's value there is whatever the register held; lort gives NaN).
UNINITIALIZED = {name for name in OPS if name.startswith("shifted") or name.endswith(("_u", "_v", "_w", "_l", "_p"))}
TOLERANCES = {torch.float32: (1.3e-4, 1e-5), torch.float64: (1e-7, 1e-7)}
N_VALUES = [*range(-2, 21), 100, 200, 600, 2.7, -0.5, math.nan, math.inf, -math.inf, 1e30]


def _x_values(dtype):
    edges = [-1.0, 1.0, 0.0, -0.0, 0.5, 0.25, 0.75, 1e-30, 1e-8, 1e4, -1e4, math.inf, -math.inf, math.nan]
    x = torch.cat([torch.linspace(-3, 3, 241, dtype=torch.float64), torch.tensor(edges, dtype=torch.float64)]).to(dtype)
    one, zero = torch.tensor(1.0, dtype=dtype), torch.tensor(0.0, dtype=dtype)
    near, below, above = [], one, -one
    for _ in range(40):  # the closed forms' and their branches' edges
        below, above = torch.nextafter(below, zero), torch.nextafter(above, zero)
        near += [below, above]
    tiny = torch.finfo(dtype).eps / 4  # x next to 0: the shifted forms' 2x - 1 next to -1
    near += [torch.tensor(k * tiny, dtype=dtype) for k in range(1, 40)]
    return torch.cat([x, torch.stack(near)])


def _compare(name, got, expected, x, n, dtype):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    keep = torch.ones(expected.shape, dtype=torch.bool)
    if name in UNINITIALIZED:
        n = n.to(dtype)
        degree = torch.where(n.abs() < 2.0**63, n, -1.0).trunc()  # x86's cast: NaN, inf, huge to INT64_MIN
        keep &= ~(x.isnan() & (degree >= 2))
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(got[keep], expected[keep], rtol=rtol, atol=atol, equal_nan=True)
    if name in UNINITIALIZED:
        assert got[~keep].isnan().all()


def _in_ort(backend):
    fallbacks = [f for record in backend.records for f in record.fallbacks]
    assert not fallbacks, fallbacks
    assert sum(record.ort_nodes for record in backend.records) > 0


def _run(fn, *args):
    return _through_lort(lambda a: fn(*a), args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", OPS)
def test_equals_eager(name, dtype):
    x = _x_values(dtype)[:, None]
    n = torch.tensor(N_VALUES, dtype=dtype)[None, :]
    got, expected, backend = _run(getattr(S, name), x, n)
    _compare(name, got, expected, x, n, dtype)
    _in_ort(backend)


@pytest.mark.parametrize("name", OPS)
def test_integer_inputs(name):
    x = torch.arange(-3, 4)[:, None]
    n = torch.tensor([-2, -1, 0, 1, 2, 3, 7, 9, 20, 100, 600])
    got, expected, backend = _run(getattr(S, name), x, n)
    _compare(name, got, expected, x, n, torch.float32)
    _in_ort(backend)


CASES = {
    "n_scalar_int": (lambda f, x, n: f(x, 25), torch.float32),
    "n_scalar_float": (lambda f, x, n: f(x, 9.75), torch.float32),
    "x_scalar": (lambda f, x, n: f(0.25, n), torch.float32),
    "x_scalar_int": (lambda f, x, n: f(2, n.to(torch.int64)), torch.float32),
    "float64_n_scalar_int": (lambda f, x, n: f(x, 12), torch.float64),
    "mixed_dtypes": (lambda f, x, n: f(x.float(), n), torch.float64),
    "zero_dim_x": (lambda f, x, n: f(x[3].double(), n.float()), torch.float32),
    "rank_3": (lambda f, x, n: f(x.reshape(3, 1, -1), n.reshape(-1, 1)), torch.float32),
    "empty": (lambda f, x, n: f(x[:0, None], n), torch.float32),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", ["chebyshev_polynomial_v", "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "legendre_polynomial_p"])
def test_overloads_and_promotion(name, case):
    fn, dtype = CASES[case]
    x = torch.linspace(-1.5, 1.5, 24, dtype=dtype)
    n = torch.arange(-1, 23, dtype=dtype)
    got, expected, backend = _run(lambda x, n: fn(getattr(S, name), x, n), x, n)
    torch.testing.assert_close(got, expected, rtol=1.3e-4, atol=1e-5, equal_nan=True)
    _in_ort(backend)


def test_the_loop_stops_with_the_last_element():
    """Eager's Chebyshev recurrence stops at a NaN q (|x| > 1 overflows, then inf - inf):
    the Loop stops when no element is left, not after max(n) trips."""
    x = torch.tensor([1.5, -2.0, 3.0])
    n = torch.tensor([1e9, 1e9, 5e8])
    start = time.perf_counter()
    got, expected, backend = _run(S.chebyshev_polynomial_t, x, n)
    assert time.perf_counter() - start < 60
    torch.testing.assert_close(got, expected, equal_nan=True)
    _in_ort(backend)


def test_float64_float_scalars_stay_in_pytorch():
    """The float64 scalar check (translate/exact_scalars.py) keeps a Python float that
    float32 cannot hold in PyTorch: correct, if needlessly (the translation is exact)."""
    x = torch.linspace(-1.5, 1.5, 24, dtype=torch.float64)
    got, expected, backend = _run(lambda x: S.legendre_polynomial_p(x, 2.9999999999), x)
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-7)
    fallbacks = [f for record in backend.records for f in record.fallbacks]
    assert [reason.kind for _, reason in fallbacks] == [ReasonKind.KNOWN_WRONG]


def test_other_devices_are_refused():
    """The CUDA kernels cast NaN and infinite n differently: a value whose FX node is
    not on the CPU fails to translate, so that the node stays in PyTorch."""
    import onnx_ir as ir

    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    node.meta["val"] = torch.empty(3, device="meta")
    value = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([3]))
    value.meta["node"] = node
    with pytest.raises(NotImplementedError, match="CPU"):
        polynomials._translate(None, value, 3)
