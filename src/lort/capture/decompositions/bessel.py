"""Bessel functions (``special_bessel_j0``, ``special_bessel_j1``, ``special_bessel_y0``,
``special_bessel_y1``, ``special_spherical_bessel_j0``; no ONNX op) as PyTorch's own
kernels compute them
(aten/src/ATen/native/Math.h, from Cephes), in the input's dtype: the rational
approximation up to 5, the asymptotic form with cos/sin beyond, the same constants and
order of operations; registered by ``decompositions.table``. Integer inputs are cast to
the default dtype first, as eager's type promotion does.
"""

from __future__ import annotations

import numpy as np
import torch

from .special import _float_input, _full

aten = torch.ops.aten

_J0_PP = (7.96936729297347051624e-04, 8.28352392107440799803e-02, 1.23953371646414299388e+00,
          5.44725003058768775090e+00, 8.74716500199817011941e+00, 5.30324038235394892183e+00,
          9.99999999999999997821e-01)
_J0_PQ = (9.24408810558863637013e-04, 8.56288474354474431428e-02, 1.25352743901058953537e+00,
          5.47097740330417105182e+00, 8.76190883237069594232e+00, 5.30605288235394617618e+00,
          1.00000000000000000218e+00)
_J0_QP = (-1.13663838898469149931e-02, -1.28252718670509318512e+00, -1.95539544257735972385e+01,
          -9.32060152123768231369e+01, -1.77681167980488050595e+02, -1.47077505154951170175e+02,
          -5.14105326766599330220e+01, -6.05014350600728481186e+00)
_J0_QQ = (6.43178256118178023184e+01, 8.56430025976980587198e+02, 3.88240183605401609683e+03,
          7.24046774195652478189e+03, 5.93072701187316984827e+03, 2.06209331660327847417e+03,
          2.42005740240291393179e+02)
_J0_RP = (-4.79443220978201773821e+09, 1.95617491946556577543e+12, -2.49248344360967716204e+14,
          9.70862251047306323952e+15)
_J0_RQ = (4.99563147152651017219e+02, 1.73785401676374683123e+05, 4.84409658339962045305e+07,
          1.11855537045356834862e+10, 2.11277520115489217587e+12, 3.10518229857422583814e+14,
          3.18121955943204943306e+16, 1.71086294081043136091e+18)

_J1_PP = (7.62125616208173112003e-04, 7.31397056940917570436e-02, 1.12719608129684925192e+00,
          5.11207951146807644818e+00, 8.42404590141772420927e+00, 5.21451598682361504063e+00,
          1.00000000000000000254e+00)
_J1_PQ = (5.71323128072548699714e-04, 6.88455908754495404082e-02, 1.10514232634061696926e+00,
          5.07386386128601488557e+00, 8.39985554327604159757e+00, 5.20982848682361821619e+00,
          9.99999999999999997461e-01)
_J1_QP = (5.10862594750176621635e-02, 4.98213872951233449420e+00, 7.58238284132545283818e+01,
          3.66779609360150777800e+02, 7.10856304998926107277e+02, 5.97489612400613639965e+02,
          2.11688757100572135698e+02, 2.52070205858023719784e+01)
_J1_QQ = (7.42373277035675149943e+01, 1.05644886038262816351e+03, 4.98641058337653607651e+03,
          9.56231892404756170795e+03, 7.99704160447350683650e+03, 2.82619278517639096600e+03,
          3.36093607810698293419e+02)
_J1_RP = (-8.99971225705559398224e+08, 4.52228297998194034323e+11, -7.27494245221818276015e+13,
          3.68295732863852883286e+15)
_J1_RQ = (6.20836478118054335476e+02, 2.56987256757748830383e+05, 8.35146791431949253037e+07,
          2.21511595479792499675e+10, 4.74914122079991414898e+12, 7.84369607876235854894e+14,
          8.95222336184627338078e+16, 5.32278620332680085395e+18)

_Y0_YP = (15592.436785523574, -14663929.59039716, 5435264770.518765, -982136065717.9115, 87590639439536.7,
          -3466283033847297.0, 4.4273326857256984e+16, -1.8495080043698668e+16)
_Y0_YQ = (1041.2835366425984, 626107.330137135, 268919633.39381415, 86400248710.3935, 20297961275010.555,
          3171577528429750.5, 2.5059625617265306e+17)
_Y1_YP = (1263204747.9017804, -647355876379.1603, 114509511541823.73, -8127702555013251.0, 2.024394757135949e+17,
          -7.788771962659501e+17)
_Y1_YQ = (594.3015923461282, 235564.09294306856, 73481194.44597217, 18760131610.870617, 3882312774962.3857,
          620557727146953.8, 6.871410873553005e+16, 3.9727060811656064e+18)

_SQRT_2_OVER_PI = 0.797884560802865355879892119868763737
_TWO_OVER_PI = 0.636619772367581343075535053490057448
_PI_4 = 0.785398163397448309615660845819875721
_3PI_4 = 2.356194490192344928846982537459627163


def _horner(z, coefficients):
    """The kernel's ``p = 0; p = p * z + c`` loop (its first step is the first constant)."""
    p = torch.zeros_like(z) + coefficients[0]
    for c in coefficients[1:]:
        p = p * z + c
    return p


def _asymptotic(x, z, pp, pq, qp, qq, phase, second_kind=False):
    """Beyond 5: (pp/pq cos(x - phase) - 5/x (qp/qq) sin(x - phase)) sqrt(2/pi) / sqrt(x)
    for j; (pp/pq sin + 5/x (qp/qq) cos) for y."""
    shifted = x - phase
    cos, sin = torch.cos(shifted), torch.sin(shifted)
    first = _horner(z, pp) / _horner(z, pq) * (sin if second_kind else cos)
    second = 5.0 / x * (_horner(z, qp) / _horner(z, qq)) * (cos if second_kind else sin)
    return ((first + second) if second_kind else (first - second)) * _SQRT_2_OVER_PI / torch.sqrt(x)


def _j0(x):
    x = torch.abs(x)
    xx = x * x
    small = (xx - 5.78318596294678452118e+00) * (xx - 3.04712623436620863991e+01) * _horner(xx, _J0_RP) / _horner(xx, _J0_RQ)
    small = torch.where(x < 0.00001, 1.0 - xx / 4.0, small)
    large = _asymptotic(x, 25.0 / xx, _J0_PP, _J0_PQ, _J0_QP, _J0_QQ, _PI_4)
    return torch.where(x <= 5.0, small, large)


def _five_over_x_squared(x):
    five_over_x = 5.0 / x
    return five_over_x * five_over_x


def _j1(x):
    negative = x < 0
    x = torch.where(negative, -x, x)
    xx = x * x
    small = _horner(xx, _J1_RP) / _horner(xx, _J1_RQ) * x * (xx - 1.46819706421238932572e+01) * (xx - 4.92184563216946036703e+01)
    large = _asymptotic(x, _five_over_x_squared(x), _J1_PP, _J1_PQ, _J1_QP, _J1_QQ, _3PI_4)
    out = torch.where(x <= 5.0, small, large)
    return torch.where(negative, -out, out)


def _second_kind_edges(x, small, large, nan_at_zero_or_below):
    """y0/y1: -inf at 0, NaN below 0, the series up to 5, the asymptotic form beyond."""
    out = torch.where(x <= 5.0, small, large)
    out = torch.where(nan_at_zero_or_below, _full(x, float("nan")), out)
    return torch.where(x == 0, _full(x, -float("inf")), out)


def _y0(x):
    xx = x * x
    small = _horner(xx, _Y0_YP) / _horner(xx, _Y0_YQ) + (_TWO_OVER_PI * torch.log(x) * _j0(x))
    large = _asymptotic(x, 25.0 / xx, _J0_PP, _J0_PQ, _J0_QP, _J0_QQ, _PI_4, second_kind=True)
    return _second_kind_edges(x, small, large, x < 0)


def _y1(x):
    xx = x * x
    small = x * (_horner(xx, _Y1_YP) / _horner(xx, _Y1_YQ)) + (_TWO_OVER_PI * (_j1(x) * torch.log(x) - 1.0 / x))
    large = _asymptotic(x, _five_over_x_squared(x), _J1_PP, _J1_PQ, _J1_QP, _J1_QQ, _3PI_4, second_kind=True)
    return _second_kind_edges(x, small, large, x <= 0)


def _on_float(fn):
    """``fn`` on x as eager's float dtype; NotImplemented for other dtypes."""

    def decomposition(x):
        x = _float_input(x)
        return NotImplemented if x is None else fn(x)

    decomposition.__name__ = fn.__name__.lstrip("_")
    return decomposition


bessel_j0, bessel_j1, bessel_y0, bessel_y1 = (_on_float(f) for f in (_j0, _j1, _y0, _y1))


def _spherical_j0(x):
    dtype = x.dtype
    xx = x * x
    # The kernel's constants T(-1.0) / T(6.0), ... divide in x's dtype.
    divide = (lambda n, d: float(np.float32(n) / np.float32(d))) if dtype == torch.float32 else (lambda n, d: n / d)
    terms = [divide(n, d) for n, d in (
        (-1.0, 6.0), (1.0, 120.0), (-1.0, 5040.0), (1.0, 362880.0), (-1.0, 39916800.0), (1.0, 6227020800.0))]
    series = torch.zeros_like(x) + terms[-1]
    for t in reversed(terms[:-1]):
        series = t + xx * series
    series = 1.0 + xx * series
    out = torch.where(torch.abs(x) < 0.5, series, torch.sin(x) / x)
    # abs(x) == inf, not isinf: torch_lib's isinf casts to float32.
    return torch.where(torch.abs(x) == float("inf"), torch.zeros_like(x), out)


spherical_bessel_j0 = _on_float(_spherical_j0)


def table() -> dict:
    return {
        aten.special_bessel_j0.default: bessel_j0,
        aten.special_bessel_j1.default: bessel_j1,
        aten.special_bessel_y0.default: bessel_y0,
        aten.special_bessel_y1.default: bessel_y1,
        aten.special_spherical_bessel_j0.default: spherical_bessel_j0,
    }
