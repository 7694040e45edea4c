"""lgamma, digamma and polygamma as elementwise ops torch_lib translates (ONNX has none of
them), following PyTorch's own CPU kernels (aten/src/ATen/native/Math.h), registered by
``decompositions.table``:

* ``digamma``: Cephes' ``calc_digamma``, in the input's dtype as the kernel computes it:
  the reflection for x < 0 (its pi / tan(pi r) term in float64), the recurrence up to
  x >= 10 as ten masked steps, the asymptotic series; PyTorch's values at 0 (-inf / +inf
  by the sign of zero), negative integers (NaN) and inf.
* ``polygamma(1, x)``: the kernel's ``trigamma``, in the input's dtype (six recurrence
  steps, the reflection with sin(pi x) of the rounded product, as the kernel rounds it).
* ``polygamma(n >= 2, x)``: (-1)^(n+1) n! zeta(n + 1, x) with Cephes' Hurwitz zeta in
  float64 (as the kernel accumulates): nine terms, then the Euler-Maclaurin tail, each
  step stopping where the kernel's MACHEP test stops it. For x < 0 the kernel sums
  about |x| terms, a count a graph cannot hold: there the reflection
  psi_n(x) = (-1)^n psi_n(1 - x) - pi d^n/dx^n cot(pi x) gives the same value (the tests
  hold it to eager's). Non-positive integers give the kernel's inf of the sign (-1)^(n+1).
* ``lgamma`` (libm's ``lgamma``): the Lanczos approximation (g = 7, 9 terms) in float64,
  with the reflection log(pi) - log|sin(pi x)| - lgamma(1 - x) below 0.5, +inf at
  non-positive integers and at +-inf.

Integer inputs are first cast to the default dtype, as eager's type promotion does; float32
lgamma and polygamma(n >= 2) are computed in float64 and rounded. Other dtypes (half,
bfloat16, complex) are left alone (NotImplemented).
"""

from __future__ import annotations

import math

import numpy as np
import torch

aten = torch.ops.aten

_MACHEP = 1.11022302462515654042e-16
_PSI_10 = 2.25175258906672110764
_DIGAMMA_A = (8.33333333333333333333e-2, -2.10927960927960927961e-2, 7.57575757575757575758e-3,
              -4.16666666666666666667e-3, 3.96825396825396825397e-3, -8.33333333333333333333e-3,
              8.33333333333333333333e-2)
_ZETA_A = (12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
           -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
           1.8152105401943546773e17, -7.1661652561756670113e18)
_LANCZOS_G = 7.0
_LANCZOS = (0.99999999999980993, 676.5203681218851, -1259.1392167224028, 771.32342877765313,
            -176.61502916214059, 12.507343278686905, -0.13857109526572012, 9.9843695780195716e-6,
            1.5056327351493116e-7)


def _float_input(x):
    """x as the float dtype eager computes in (integers and bools: the default dtype),
    or None where the decomposition does not apply."""
    if not isinstance(x, torch.Tensor) or x.dtype.is_complex:
        return None
    if not x.dtype.is_floating_point:
        x = aten._to_copy.default(x, dtype=torch.get_default_dtype())
    return x if x.dtype in (torch.float32, torch.float64) else None


def _in(dtype, value):
    """A Python float rounded as the kernel's constant of ``dtype`` is."""
    return float(np.float32(value)) if dtype == torch.float32 else float(value)


def _full(like, value):
    """``like``'s shape filled with ``value``, exact in float64 (lort keeps a full_like
    whose float value float32 would round in PyTorch; a scalar_tensor is exact)."""
    return aten.add.Tensor(aten.zeros_like.default(like), aten.scalar_tensor.default(value, dtype=like.dtype))


def _is_integer(x):
    return aten.eq.Tensor(x, aten.floor.default(x))


def _float64(x):
    return aten._to_copy.default(x, dtype=torch.float64)


def _cast(x, dtype):
    return x if x.dtype == dtype else aten._to_copy.default(x, dtype=dtype)


# pi as float64 parts, the first two of 30 significant bits (k * part is exact for |k| < 2^23).
_PI_PARTS = (3.141592651605606, 1.9841871583270443e-09, 1.034036596358821e-18)


def _reduce_by_pi(p):
    """(u, k) with p = k pi + u, |u| <= pi / 2, u to float64 accuracy for |p| < 2^23 pi
    (Cody and Waite's reduction): ORT's Sin/Cos of a float64 near a multiple of pi lose
    the digits libm keeps (sin(-pi) was 0, libm's -1.2e-16)."""
    k = torch.round(p / _PI_PARTS[0])
    u = p
    for part in _PI_PARTS:
        u = u - k * part
    return u, k


def _sin(p):
    """sin(p) of float64 p, as libm's: (-1)^k sin(u) below 2^20 (ORT's own Sin is
    accurate to the last digits for larger |p|, not within a few pi of zero)."""
    u, k = _reduce_by_pi(p)
    odd = (k - 2 * torch.floor(k * 0.5)) != 0
    s = torch.sin(u)
    return torch.where(torch.abs(p) < 2.0**20, torch.where(odd, -s, s), torch.sin(p))


# -- digamma --------------------------------------------------------------------------


def digamma(x):
    x = _float_input(x)
    if x is None:
        return NotImplemented
    dtype = x.dtype
    negative = x < 0
    y = torch.where(negative, 1 - x, x)
    result = torch.zeros_like(x)
    for _ in range(10):  # y >= 10 after ten steps for every y > 0 (1 - x > 1 for x < 0)
        below = y < 10
        result = torch.where(below, result - 1 / y, result)
        y = torch.where(below, y + 1, y)
    z = 1 / (y * y)
    poly = _full(z, _in(dtype, _DIGAMMA_A[0]))
    for c in _DIGAMMA_A[1:]:
        poly = poly * z + _in(dtype, c)
    series = torch.where(y < _in(dtype, 1.0e17), z * poly, torch.zeros_like(z))
    out = result + torch.log(y) - _in(dtype, 0.5) / y - series
    out = torch.where(y == 10, result + _in(dtype, _PSI_10), out)
    # Reflection: psi(x) = psi(1 - x) - pi / tan(pi r), r the fractional part, in float64.
    x64 = _float64(x)
    u, _ = _reduce_by_pi(math.pi * (x64 - aten.ceil.default(x64)))  # tan has period pi
    out = torch.where(negative, out - _cast(math.pi / (torch.sin(u) / torch.cos(u)), dtype), out)
    out = torch.where(negative & _is_integer(x), _full(x, math.nan), out)
    return torch.where(x == 0, -1 / x, out)  # copysign(inf, -x) at +-0


# -- trigamma and polygamma -----------------------------------------------------------


def trigamma(x):
    """The kernel's ``trigamma`` in x's dtype (float32 or float64)."""
    dtype = x.dtype
    pi = _in(dtype, math.pi)
    small = x < 0.5
    s = _cast(_sin(_float64(x * pi)), dtype)  # sin of the product rounded in x's dtype
    result = torch.where(small, 0 - _in(dtype, pi * pi) / (s * s), torch.zeros_like(x))
    y = torch.where(small, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (y * y)
        y = y + 1
    ixx = 1 / (y * y)
    inner = _in(dtype, 1 / 6) - ixx * (_in(dtype, 1 / 30) - ixx * _in(dtype, 1 / 42))
    result = result + (1 + 1 / (2 * y) + ixx * inner) / y
    return torch.where(small, -result, result)


def _zeta_positive(order: float, q):
    """Cephes' zeta(order, q) for q > 0 (float64 q), stopping where the kernel stops."""
    s = torch.pow(q, -order)
    a = q
    b = torch.zeros_like(q)
    done = torch.zeros_like(q, dtype=torch.bool)
    for _ in range(9):  # for q > 0 the kernel's loop runs exactly nine times
        a = a + 1
        b = torch.pow(a, -order)
        s = torch.where(done, s, s + b)
        done = done | ((-_MACHEP * s < b) & (b < _MACHEP * s))
    w = a
    tail = torch.where(done, s, s + b * w / (order - 1) - 0.5 * b)
    c, k = 1.0, 0.0
    for coefficient in _ZETA_A:
        c *= order + k
        b = b / w
        t = c * b / coefficient
        tail_next = tail + t
        tail = torch.where(done, tail, tail_next)
        done = done | (torch.abs(t / tail_next) < _MACHEP)
        k += 1.0
        c *= order + k
        b = b / w
        k += 1.0
    return tail


def _cot_derivative_polynomial(n: int) -> list[int]:
    """Coefficients (by power) of P_n with d^n/dx^n cot(pi x) = pi^n P_n(cot(pi x)):
    P_0(c) = c, P_{k+1}(c) = -(1 + c^2) P_k'(c)."""
    p = [0, 1]
    for _ in range(n):
        derivative = [i * p[i] for i in range(1, len(p))] + [0]
        nxt = [0] * (len(derivative) + 2)
        for i, coefficient in enumerate(derivative):
            nxt[i] -= coefficient
            nxt[i + 2] -= coefficient
        p = nxt
    while p and p[-1] == 0:
        p.pop()
    return p


def _polygamma_of_positive(n: int, q):
    return ((-1.0) ** (n + 1) * float(math.factorial(n))) * _zeta_positive(float(n + 1), q)


def _polygamma_float64(n: int, x):
    """(-1)^(n+1) n! zeta(n + 1, x) for float64 x, n >= 2."""
    positive = x > 0
    q = torch.where(positive, x, 1 - x)  # 1 - x > 1 for the reflected x < 0
    direct = _polygamma_of_positive(n, q)
    r = x - torch.round(x)
    cot = torch.cos(math.pi * r) / torch.sin(math.pi * r)
    coefficients = _cot_derivative_polynomial(n)
    poly = _full(x, float(coefficients[-1]))
    for coefficient in reversed(coefficients[:-1]):
        poly = poly * cot + float(coefficient)
    reflected = (-1.0) ** n * direct - math.pi ** (n + 1) * poly
    out = torch.where(positive, direct, reflected)
    pole = (~positive) & _is_integer(x)  # zeta is +inf there; the sign is (-1)^(n+1)
    return torch.where(pole, _full(x, (-1.0) ** (n + 1) * math.inf), out)


def polygamma(n, x):
    if not isinstance(n, int) or n < 0:
        return NotImplemented
    x = _float_input(x)
    if x is None:
        return NotImplemented
    if n == 0:
        return digamma(x)
    if n == 1:
        return trigamma(x)
    return _cast(_polygamma_float64(n, _float64(x)), x.dtype)


# -- lgamma ---------------------------------------------------------------------------


def _lgamma_lanczos(z):
    """log|Gamma(z)| for z >= 0.5 (float64)."""
    z1 = z - 1
    series = _full(z, _LANCZOS[0])
    for i, coefficient in enumerate(_LANCZOS[1:], start=1):
        series = series + coefficient / (z1 + i)
    t = z1 + (_LANCZOS_G + 0.5)
    return (0.5 * math.log(2 * math.pi) + (z1 + 0.5) * torch.log(t)) - t + torch.log(series)


def lgamma(x):
    x = _float_input(x)
    if x is None:
        return NotImplemented
    x64 = _float64(x)
    reflect = x64 < 0.5
    body = _lgamma_lanczos(torch.where(reflect, 1 - x64, x64))
    r = x64 - torch.round(x64)
    reflected = (math.log(math.pi) - torch.log(torch.abs(torch.sin(math.pi * r)))) - body  # no overflow at tiny x
    out = torch.where(reflect, reflected, body)
    # abs(x) == inf, not isinf: torch_lib's isinf casts to float32 (1e300 would be inf).
    pole = (torch.abs(x64) == math.inf) | ((x64 <= 0) & _is_integer(x64))
    return _cast(torch.where(pole, _full(x64, math.inf), out), x.dtype)


def table() -> dict:
    """The decompositions above, by the op they replace (PyTorch's own decompose lgamma
    and digamma into prims without a translation)."""
    prims = torch.ops.prims
    return {
        aten.lgamma.default: lgamma,
        prims.lgamma.default: lgamma,
        aten.digamma.default: digamma,
        prims.digamma.default: digamma,
        aten.polygamma.default: polygamma,
    }
