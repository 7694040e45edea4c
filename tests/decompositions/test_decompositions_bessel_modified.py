"""lort's modified Bessel functions i0, i1, k0, k1, scaled k0, k1 and Airy Ai
(lort.capture.decompositions.bessel_modified) against eager PyTorch: the decompositions
themselves, bitwise where they are given libm's exp, log, sin and cos as the kernels are,
and the ops through lort with every node in ORT, on a dense range, the kernels' branch
points and PyTorch's edge values (zeros of both signs, tiny, huge, +-inf, NaN)."""

import ctypes
import ctypes.util
import math
import types

import pytest
import torch

from lort.backend import LortBackend
from lort.capture.decompositions import bessel_modified as dbm

# Float32 as the conformance sweep (lort's differences are ORT's exp, log, sin and cos
# against libm's: a few ulp); float64 far tighter than its 1e-7.
TOLERANCES = {torch.float32: (1.3e-4, 1e-5), torch.float64: (1e-12, 1e-14)}

OPS = {
    "modified_bessel_i0": (dbm.modified_bessel_i0, torch.special.modified_bessel_i0),
    "modified_bessel_i1": (dbm.modified_bessel_i1, torch.special.modified_bessel_i1),
    "modified_bessel_k0": (dbm.modified_bessel_k0, torch.special.modified_bessel_k0),
    "modified_bessel_k1": (dbm.modified_bessel_k1, torch.special.modified_bessel_k1),
    "scaled_modified_bessel_k0": (dbm.scaled_modified_bessel_k0, torch.special.scaled_modified_bessel_k0),
    "scaled_modified_bessel_k1": (dbm.scaled_modified_bessel_k1, torch.special.scaled_modified_bessel_k1),
    "airy_ai": (dbm.airy_ai, torch.special.airy_ai),
}
# The kernels' branch points (2, 8; Airy's -2.09, 2.09, 8.3203353, 103.892) and edges.
EDGES = [0.0, -0.0, 1e-30, -1e-30, 1e-5, -1e-5, 2.0, 2.0000002, 1.9999999, 8.0, 8.000001, -8.0, 2.09, -2.09, 2.0899999,
         -2.0900001, 8.3203353, 103.892, 103.9, 104.0, 700.0, 710.0, -700.0, -710.0, 1e4, -1e4, 1e30, -1e30,
         math.inf, -math.inf, math.nan]


def _inputs(dtype, dense=6001):
    g = torch.Generator().manual_seed(0)
    return torch.cat([
        torch.linspace(-30, 30, dense, dtype=torch.float64),
        torch.tensor(EDGES, dtype=torch.float64),
        (torch.rand(1000, generator=g, dtype=torch.float64) - 0.5) * 300,
    ]).to(dtype)


def _close(got, expected, dtype):
    rtol, atol = TOLERANCES[dtype]
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decomposition_equals_eager(name, dtype):
    mine, eager = OPS[name]
    x = _inputs(dtype)
    if name == "airy_ai" and dtype == torch.float32:
        # Eager's float32 sqrt is off by an ulp in some builds (not ORT's, nor libm's):
        # below -60 that moves Ai's phase by more than atol.
        x = x[~(x < -60)]
    _close(mine(x), eager(x), dtype)


@pytest.mark.parametrize("name", list(OPS))
def test_integer_inputs_promote_as_eager(name):
    mine, eager = OPS[name]
    x = torch.arange(-40, 120)
    _close(mine(x), eager(x), torch.float32)


def test_other_dtypes_are_left_alone():
    assert dbm.modified_bessel_i0(torch.ones(3, dtype=torch.bfloat16)) is NotImplemented
    assert dbm.airy_ai(torch.ones(3, dtype=torch.float16)) is NotImplemented
    assert dbm.modified_bessel_k1(torch.ones(3, dtype=torch.complex64)) is NotImplemented


def _libm():
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    functions = {}
    for name in ("exp", "log", "sqrt", "sin", "cos"):
        single, double = getattr(libm, name + "f"), getattr(libm, name)
        single.restype, single.argtypes = ctypes.c_float, [ctypes.c_float]
        double.restype, double.argtypes = ctypes.c_double, [ctypes.c_double]

        def apply(x, single=single, double=double):
            fn = single if x.dtype == torch.float32 else double
            values = [fn(v) for v in x.reshape(-1).tolist()]
            return torch.tensor(values, dtype=x.dtype).reshape(x.shape)

        functions[name] = apply
    return functions


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="eager's kernels fuse multiply-adds only in the AVX2 and AVX512 builds")
@pytest.mark.parametrize("name", list(OPS))
def test_float32_is_the_kernel_bitwise(name, monkeypatch):
    """With the functions the kernels call (libm's expf, logf, sinf, cosf; log for k0's
    double term) the float32 decompositions are eager's kernels bit for bit: the same
    constants, operations, order and fused multiply-adds."""
    shim = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    for fn_name, fn in _libm().items():
        setattr(shim, fn_name, fn)
    monkeypatch.setattr(dbm, "torch", shim)
    mine, eager = OPS[name]
    x = _inputs(torch.float32, dense=2001)
    got, expected = mine(x), eager(x)
    same = (got == expected) | (got.isnan() & expected.isnan())
    assert same.all(), x[~same].tolist()[:10]


def _through_lort(fn, x):
    backend = LortBackend({"executor": "ort", "mode": "ort", "disk_cache": False})
    torch._dynamo.reset()
    try:
        got = torch.compile(fn, backend=backend)(x)
    finally:
        torch._dynamo.reset()
    fallbacks = [f for record in backend.records for f in record.fallbacks]
    assert not fallbacks, fallbacks
    assert sum(r.torch_nodes for r in backend.records) == 0
    assert sum(r.ort_nodes for r in backend.records) > 0
    return got


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_through_lort(name, dtype):
    """ORT's exp, log, sin, cos and sqrt in place of libm's: still eager's values, every
    node in ORT."""
    eager = OPS[name][1]
    x = _inputs(dtype)
    _close(_through_lort(eager, x), eager(x), dtype)


def test_integer_inputs_through_lort():
    def every_op(x):
        return torch.stack([eager(x) for _, eager in OPS.values()])

    x = torch.arange(-40, 120)
    _close(_through_lort(every_op, x), every_op(x), torch.float32)
