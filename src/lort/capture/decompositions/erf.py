"""The error function family in ops ORT runs (registered by ``decompositions.table``):
``erf`` where ORT has no Erf kernel for the dtype (float64 on CPU), ``erfc``,
``special_erfcx``, ``special_ndtri``, ``erfinv`` and ``special_log_ndtr``, whose
PyTorch decompositions end in prims with no ONNX form.

erf and erfc are Cephes' (ndtr.c, whose coefficients glibc's and PyTorch's kernels
match to the last bits): ``x T(x^2) / U(x^2)`` for |x| <= 1, ``exp(-x^2) P(x) / Q(x)``
for 1 <= x < 8 and ``exp(-x^2) R(x) / S(x)`` beyond. erfcx (eager: the Faddeeva
package's Chebyshev fits) uses the same rational functions without the exponential,
and beyond 26 its asymptotic series.
ndtri is PyTorch's kernel (calc_ndtri, from Cephes), erfinv PyTorch's rational start and
two Newton steps (calc_erfinv), log_ndtr PyTorch's two branches (calc_log_ndtr). float32
inputs are computed in float64 and rounded once at the end; integers are cast to the
default dtype first, as eager's type promotion does.
"""

from __future__ import annotations

import math

import torch

from ...fusion import support
from .special import _float_input, _full

aten = torch.ops.aten

_T = (9.60497373987051638749E0, 9.00260197203842689217E1, 2.23200534594684319226E3,
      7.00332514112805075473E3, 5.55923013010394962768E4)
_U = (1.0, 3.35617141647503099647E1, 5.21357949780152679795E2, 4.59432382970980127987E3,
      2.26290000613890934246E4, 4.92673942608635921086E4)
_P = (2.46196981473530512524E-10, 5.64189564831068821977E-1, 7.46321056442269912687E0,
      4.86371970985681366614E1, 1.96520832956077098242E2, 5.26445194995477358631E2,
      9.34528527171957607540E2, 1.02755188689515710272E3, 5.57535335369399327526E2)
_Q = (1.0, 1.32281951154744992508E1, 8.67072140885989742329E1, 3.54937778887819891062E2,
      9.75708501743205489753E2, 1.82390916687909736289E3, 2.24633760818710981792E3,
      1.65666309194161350182E3, 5.57535340817727675546E2)
_R = (5.64189583547755073984E-1, 1.27536670759978104416E0, 5.01905042251180477414E0,
      6.16021097993053585195E0, 7.40974269950448939160E0, 2.97886665372100240670E0)
_S = (1.0, 2.26052863220117276590E0, 9.39603524938001434673E0, 1.20489539808096656605E1,
      1.70814450747565897222E1, 9.60896809063285878198E0, 3.36907645100081516050E0)

_NDTRI_P0 = (-5.99633501014107895267E1, 9.80010754185999661536E1, -5.66762857469070293439E1,
             1.39312609387279679503E1, -1.23916583867381258016E0)
_NDTRI_Q0 = (1.0, 1.95448858338141759834E0, 4.67627912898881538453E0, 8.63602421390890590575E1,
             -2.25462687854119370527E2, 2.00260212380060660359E2, -8.20372256168333339912E1,
             1.59056225126211695515E1, -1.18331621121330003142E0)
_NDTRI_P1 = (4.05544892305962419923E0, 3.15251094599893866154E1, 5.71628192246421288162E1,
             4.40805073893200834700E1, 1.46849561928858024014E1, 2.18663306850790267539E0,
             -1.40256079171354495875E-1, -3.50424626827848203418E-2, -8.57456785154685413611E-4)
_NDTRI_Q1 = (1.0, 1.57799883256466749731E1, 4.53907635128879210584E1, 4.13172038254672030440E1,
             1.50425385692907503408E1, 2.50464946208309415979E0, -1.42182922854787788574E-1,
             -3.80806407691578277194E-2, -9.33259480895457427372E-4)
_NDTRI_P2 = (3.23774891776946035970E0, 6.91522889068984211695E0, 3.93881025292474443415E0,
             1.33303460815807542389E0, 2.01485389549179081538E-1, 1.23716634817820021358E-2,
             3.01581553508235416007E-4, 2.65806974686737550832E-6, 6.23974539184983293730E-9)
_NDTRI_Q2 = (1.0, 6.02427039364742014255E0, 3.67983563856160859403E0, 1.37702099489081330271E0,
             2.16236993594496635890E-1, 1.34204006088543189037E-2, 3.28014464682127739104E-4,
             2.89247864745380683936E-6, 6.79019408009981274425E-9)
_EXP_MINUS_2 = 0.13533528323661269189
_SQRT_2PI = 2.50662827463100050242E0

# calc_erfinv's rational approximations (central |y| <= 0.7, and the tails).
_ERFINV_A = (0.886226899, -1.645349621, 0.914624893, -0.140543331)
_ERFINV_B = (-2.118377725, 1.442710462, -0.329097515, 0.012229801)
_ERFINV_C = (-1.970840454, -1.624906493, 3.429567803, 1.641345311)
_ERFINV_D = (3.543889200, 1.637067800)


def _polevl(x, coefficients):
    """Horner's rule, highest degree first (Cephes' polevl; p1evl with a leading 1.0)."""
    p = x * coefficients[0] + coefficients[1]
    for c in coefficients[2:]:
        p = p * x + c
    return p


def _erf_small(x):
    """erf for |x| <= 1."""
    z = x * x
    return x * _polevl(z, _T) / _polevl(z, _U)


def _ratio(ax):
    """erfc(x) * exp(x^2) for x >= 1 (Cephes' P/Q below 8, R/S beyond); x is clamped to
    30, where erfc is 0 (the caller selects 0 or the asymptotic series there)."""
    x = aten.minimum.default(ax, _full(ax, 30.0))
    return torch.where(x < 8.0, _polevl(x, _P) / _polevl(x, _Q), _polevl(x, _R) / _polevl(x, _S))


def _erfc_positive(ax):
    """erfc for x >= 1 (0 where it underflows)."""
    out = torch.exp(-(ax * ax)) * _ratio(ax)
    return torch.where(ax > 27.3, torch.zeros_like(ax), out)


def _erf(x):
    ax = torch.abs(x)
    big = 1.0 - _erfc_positive(ax)
    return torch.where(ax <= 1.0, _erf_small(x), torch.where(x < 0, -big, big))


def _erfc(x):
    ax = torch.abs(x)
    tail = _erfc_positive(ax)
    return torch.where(ax < 1.0, 1.0 - _erf_small(x), torch.where(x < 0, 2.0 - tail, tail))


#: erfcx(x) ~ (1 / (x sqrt(pi))) sum_n (-1)^n (2n - 1)!! / (2 x^2)^n: seven terms; beyond
#: x = 26 the first left out is below 2e-17 of the sum.
_ASYMPTOTIC = tuple((-1) ** n * math.prod(range(1, 2 * n, 2)) / 2**n for n in range(7))


def _erfcx_positive(x):
    """erfcx for x >= 0."""
    below_1 = torch.exp(x * x) * (1.0 - _erf_small(aten.minimum.default(x, _full(x, 1.0))))
    t = 1.0 / (x * x)
    series = _ASYMPTOTIC[-1]
    for c in reversed(_ASYMPTOTIC[:-1]):
        series = c + t * series
    asymptotic = (1.0 / math.sqrt(math.pi)) / x * series
    out = torch.where(x < 1.0, below_1, _ratio(x))
    return torch.where(x >= 26.0, asymptotic, out)


def _erfcx(x):
    ax = torch.abs(x)
    positive = _erfcx_positive(ax)
    return torch.where(x < 0, 2.0 * torch.exp(x * x) - positive, positive)


def _ndtri(y):
    flip = y > 1.0 - _EXP_MINUS_2
    yy = torch.where(flip, 1.0 - y, y)
    c = yy - 0.5
    c2 = c * c
    central = (c + c * (c2 * _polevl(c2, _NDTRI_P0) / _polevl(c2, _NDTRI_Q0))) * _SQRT_2PI
    x = torch.sqrt(-2.0 * torch.log(yy))
    z = 1.0 / x
    x1 = torch.where(x < 8.0, z * _polevl(z, _NDTRI_P1) / _polevl(z, _NDTRI_Q1),
                     z * _polevl(z, _NDTRI_P2) / _polevl(z, _NDTRI_Q2))
    tail = x - torch.log(x) / x - x1
    tail = torch.where(flip, tail, -tail)
    out = torch.where(yy > _EXP_MINUS_2, central, tail)
    out = torch.where(y == 0, _full(y, -math.inf), out)
    out = torch.where(y == 1, _full(y, math.inf), out)
    return torch.where((y < 0) | (y > 1), _full(y, math.nan), out)


def _erfinv(y):
    ay = torch.abs(y)
    z = y * y
    central = y * _polevl(z, _ERFINV_A[::-1]) / (_polevl(z, _ERFINV_B[::-1]) * z + 1.0)
    t = torch.sqrt(-torch.log((1.0 - ay) / 2.0))
    numerator = torch.abs(_polevl(t, _ERFINV_C[::-1]))
    tail = torch.where(y < 0, -numerator, numerator) / (_polevl(t, _ERFINV_D[::-1]) * t + 1.0)
    x = torch.where(ay <= 0.7, central, tail)
    scale = 2.0 / math.sqrt(math.pi)
    for _ in range(2):
        x = x - (_erf(x) - y) / (scale * torch.exp(-(x * x)))
    x = torch.where(ay == 1.0, torch.where(y < 0, _full(y, -math.inf), _full(y, math.inf)), x)
    return torch.where(ay > 1.0, _full(y, math.nan), x)


def _log_ndtr(x):
    t = x * math.sqrt(0.5)
    below = torch.log(_erfcx(-t) / 2.0) - t * t
    above = torch.log1p(-_erfc(t) / 2.0)
    return torch.where(x < -1.0, below, above)


def _in_float64(fn, when=None):
    """``fn`` on x as eager's float dtype, computed in float64; ``when(x)`` False (or a
    non-float input) leaves the op whole."""

    def decomposition(x):
        x = _float_input(x)
        if x is None or (when is not None and not when(x)):
            return NotImplemented
        wide = x if x.dtype == torch.float64 else aten._to_copy.default(x, dtype=torch.float64)
        out = fn(wide)
        return out if x.dtype == torch.float64 else aten._to_copy.default(out, dtype=x.dtype)

    decomposition.__name__ = fn.__name__.lstrip("_")
    return decomposition


def _no_erf_kernel(x) -> bool:
    return not support.ort_has_kernel("Erf", x.dtype, x.device)


def table() -> dict:
    return {
        aten.erf.default: _in_float64(_erf, when=_no_erf_kernel),
        aten.erfc.default: _in_float64(_erfc),
        aten.special_erfcx.default: _in_float64(_erfcx),
        aten.special_ndtri.default: _in_float64(_ndtri),
        aten.erfinv.default: _in_float64(_erfinv),
        aten.special_log_ndtr.default: _in_float64(_log_ndtr),
    }
