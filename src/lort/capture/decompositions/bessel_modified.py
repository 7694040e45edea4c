"""Modified Bessel functions (``special_modified_bessel_i0``, ``_i1``, ``_k0``, ``_k1``,
``special_scaled_modified_bessel_k0``, ``_k1``; ``i0`` and ``special_i0e``, ``_i1``,
``_i1e``, whose kernels use the same series) and the Airy function
(``special_airy_ai``; no ONNX op) as PyTorch's own kernels compute them
(aten/src/ATen/native/Math.h, from Cephes): the same Chebyshev series and rational
approximations, the same constants, branches and order of operations, in the input's
dtype, except where the kernel itself computes in double (k0's ``log(0.5 * x)`` term),
and with the kernels' fused multiply-adds (``_fused``); registered by
``decompositions.table``. Integer inputs are cast to the default dtype first, as eager's
type promotion does. Given libm's exp, log, sin and cos, float32 is eager's kernel bit
for bit; float64 differs by the fused multiply-adds it leaves unfused (``_fused``).
Through ORT the results differ by ORT's exp, log, sin and cos against libm's: a few ulp
(more, relative to the value, next to Ai's zeros); tests/decompositions/test_decompositions_bessel_modified.py.

Python's ``c / tensor`` is ``reciprocal(tensor) * c``, which rounds twice: a constant
divided by a tensor goes through ``_rdiv``, a true division, as the kernels divide.
"""

from __future__ import annotations

import math

import torch

from .bessel import _on_float
from .special import _cast, _full, _in

aten = torch.ops.aten

_I0_A = (-4.41534164647933937950e-18, 3.33079451882223809783e-17, -2.43127984654795469359e-16,
        1.71539128555513303061e-15, -1.16853328779934516808e-14, 7.67618549860493561688e-14,
        -4.85644678311192946090e-13, 2.95505266312963983461e-12, -1.72682629144155570723e-11,
        9.67580903537323691224e-11, -5.18979560163526290666e-10, 2.65982372468238665035e-09,
        -1.30002500998624804212e-08, 6.04699502254191894932e-08, -2.67079385394061173391e-07,
        1.11738753912010371815e-06, -4.41673835845875056359e-06, 1.64484480707288970893e-05,
        -5.75419501008210370398e-05, 1.88502885095841655729e-04, -5.76375574538582365885e-04,
        1.63947561694133579842e-03, -4.32430999505057594430e-03, 1.05464603945949983183e-02,
        -2.37374148058994688156e-02, 4.93052842396707084878e-02, -9.49010970480476444210e-02,
        1.71620901522208775349e-01, -3.04682672343198398683e-01, 6.76795274409476084995e-01)
_I0_B = (-7.23318048787475395456e-18, -4.83050448594418207126e-18, 4.46562142029675999901e-17,
        3.46122286769746109310e-17, -2.82762398051658348494e-16, -3.42548561967721913462e-16,
        1.77256013305652638360e-15, 3.81168066935262242075e-15, -9.55484669882830764870e-15,
        -4.15056934728722208663e-14, 1.54008621752140982691e-14, 3.85277838274214270114e-13,
        7.18012445138366623367e-13, -1.79417853150680611778e-12, -1.32158118404477131188e-11,
        -3.14991652796324136454e-11, 1.18891471078464383424e-11, 4.94060238822496958910e-10,
        3.39623202570838634515e-09, 2.26666899049817806459e-08, 2.04891858946906374183e-07,
        2.89137052083475648297e-06, 6.88975834691682398426e-05, 3.36911647825569408990e-03,
        8.04490411014108831608e-01)
_I1_A = (2.77791411276104639959e-18, -2.11142121435816608115e-17, 1.55363195773620046921e-16,
        -1.10559694773538630805e-15, 7.60068429473540693410e-15, -5.04218550472791168711e-14,
        3.22379336594557470981e-13, -1.98397439776494371520e-12, 1.17361862988909016308e-11,
        -6.66348972350202774223e-11, 3.62559028155211703701e-10, -1.88724975172282928790e-09,
        9.38153738649577178388e-09, -4.44505912879632808065e-08, 2.00329475355213526229e-07,
        -8.56872026469545474066e-07, 3.47025130813767847674e-06, -1.32731636560394358279e-05,
        4.78156510755005422638e-05, -1.61760815825896745588e-04, 5.12285956168575772895e-04,
        -1.51357245063125314899e-03, 4.15642294431288815669e-03, -1.05640848946261981558e-02,
        2.47264490306265168283e-02, -5.29459812080949914269e-02, 1.02643658689847095384e-01,
        -1.76416518357834055153e-01, 2.52587186443633654823e-01)
_I1_B = (7.51729631084210481353e-18, 4.41434832307170791151e-18, -4.65030536848935832153e-17,
        -3.20952592199342395980e-17, 2.96262899764595013876e-16, 3.30820231092092828324e-16,
        -1.88035477551078244854e-15, -3.81440307243700780478e-15, 1.04202769841288027642e-14,
        4.27244001671195135429e-14, -2.10154184277266431302e-14, -4.08355111109219731823e-13,
        -7.19855177624590851209e-13, 2.03562854414708950722e-12, 1.41258074366137813316e-11,
        3.25260358301548823856e-11, -1.89749581235054123450e-11, -5.58974346219658380687e-10,
        -3.83538038596423702205e-09, -2.63146884688951950684e-08, -2.51223623787020892529e-07,
        -3.88256480887769039346e-06, -1.10588938762623716291e-04, -9.76109749136146840777e-03,
        7.78576235018280120474e-01)
_K0_A = (1.37446543561352307156e-16, 4.25981614279661018399e-14, 1.03496952576338420167e-11,
        1.90451637722020886025e-09, 2.53479107902614945675e-07, 2.28621210311945178607e-05,
        1.26461541144692592338e-03, 3.59799365153615016266e-02, 3.44289899924628486886e-01,
        -5.35327393233902768720e-01)
_K0_B = (5.30043377268626276149e-18, -1.64758043015242134646e-17, 5.21039150503902756861e-17,
        -1.67823109680541210385e-16, 5.51205597852431940784e-16, -1.84859337734377901440e-15,
        6.34007647740507060557e-15, -2.22751332699166985548e-14, 8.03289077536357521100e-14,
        -2.98009692317273043925e-13, 1.14034058820847496303e-12, -4.51459788337394416547e-12,
        1.85594911495471785253e-11, -7.95748924447710747776e-11, 3.57739728140030116597e-10,
        -1.69753450938905987466e-09, 8.57403401741422608519e-09, -4.66048989768794782956e-08,
        2.76681363944501510342e-07, -1.83175552271911948767e-06, 1.39498137188764993662e-05,
        -1.28495495816278026384e-04, 1.56988388573005337491e-03, -3.14481013119645005427e-02,
        2.44030308206595545468e+00)
_K1_A = (-7.02386347938628759343e-18, -2.42744985051936593393e-15, -6.66690169419932900609e-13,
        -1.41148839263352776110e-10, -2.21338763073472585583e-08, -2.43340614156596823496e-06,
        -1.73028895751305206302e-04, -6.97572385963986435018e-03, -1.22611180822657148235e-01,
        -3.53155960776544875667e-01, 1.52530022733894777053e+00)
_K1_B = (-5.75674448366501715755e-18, 1.79405087314755922667e-17, -5.68946255844285935196e-17,
        1.83809354436663880070e-16, -6.05704724837331885336e-16, 2.03870316562433424052e-15,
        -7.01983709041831346144e-15, 2.47715442448130437068e-14, -8.97670518232499435011e-14,
        3.34841966607842919884e-13, -1.28917396095102890680e-12, 5.13963967348173025100e-12,
        -2.12996783842756842877e-11, 9.21831518760500529508e-11, -4.19035475934189648750e-10,
        2.01504975519703286596e-09, -1.03457624656780970260e-08, 5.74108412545004946722e-08,
        -3.50196060308781257119e-07, 2.40648494783721712015e-06, -1.93619797416608296024e-05,
        1.95215518471351631108e-04, -2.85781685962277938680e-03, 1.03923736576817238437e-01,
        2.72062619048444266945e+00)
_AIRY_AN = (3.46538101525629032477e-01, 1.20075952739645805542e+01, 7.62796053615234516538e+01,
           1.68089224934630576269e+02, 1.59756391350164413639e+02, 7.05360906840444183113e+01,
           1.40264691163389668864e+01, 9.99999999999999995305e-01)
_AIRY_AD = (5.67594532638770212846e-01, 1.47562562584847203173e+01, 8.45138970141474626562e+01,
           1.77318088145400459522e+02, 1.64234692871529701831e+02, 7.14778400825575695274e+01,
           1.40959135607834029598e+01, 1.00000000000000000470e+00)
_AIRY_AFN = (-1.31696323418331795333e-01, -6.26456544431912369773e-01, -6.93158036036933542233e-01,
            -2.79779981545119124951e-01, -4.91900132609500318020e-02, -4.06265923594885404393e-03,
            -1.59276496239262096340e-04, -2.77649108155232920844e-06, -1.67787698489114633780e-08)
_AIRY_AFD = (1.33560420706553243746e+01, 3.26825032795224613948e+01, 2.67367040941499554804e+01,
            9.18707402907259625840e+00, 1.47529146771666414581e+00, 1.15687173795188044134e-01,
            4.40291641615211203805e-03, 7.54720348287414296618e-05, 4.51850092970580378464e-07)
_AIRY_AGN = (1.97339932091685679179e-02, 3.91103029615688277255e-01, 1.06579897599595591108e+00,
            9.39169229816650230044e-01, 3.51465656105547619242e-01, 6.33888919628925490927e-02,
            5.85804113048388458567e-03, 2.82851600836737019778e-04, 6.98793669997260967291e-06,
            8.11789239554389293311e-08, 3.41551784765923618484e-10)
_AIRY_AGD = (9.30892908077441974853e+00, 1.98352928718312140417e+01, 1.55646628932864612953e+01,
            5.47686069422975497931e+00, 9.54293611618961883998e-01, 8.64580826352392193095e-02,
            4.12656523824222607191e-03, 1.01259085116509135510e-04, 1.17166733214413521882e-06,
            4.91834570062930015649e-09)

_AIRY_SCALE = 5.64189583547756286948e-01  # 1 / sqrt(pi)
_AIRY_C1 = 0.355028053887817239260
_AIRY_C2 = 0.258819403792806798405
# The power series' longest run for |x| < 2.09 (until |m / f| <= eps): 10 steps in
# float32, 14 in float64; later steps leave finished elements as they are.
_AIRY_SERIES_STEPS = {torch.float32: 12, torch.float64: 16}


def _rdiv(numerator: float, x):
    """``numerator / x`` as one division."""
    return torch.div(aten.scalar_tensor.default(numerator, dtype=x.dtype, device=x.device), x)


def _fused(a, b, c):
    """``a * b + c``, as the kernels' compiled code computes it: GCC contracts it into one
    fused multiply-add, rounded once, in PyTorch's AVX2 and AVX512 builds. float32: in
    float64, where the product is exact, then rounded to float32 (twice rounded: differs
    from the fused result only where the float64 sum falls exactly halfway between two
    float32). float64: unfused, rounded twice (an exact emulation, Dekker's product and a
    two-sum, tripled the graph and its compile time for a few ulp that ORT's exp and log,
    not libm's, leave anyway)."""
    if a.dtype != torch.float32:
        return a * b + c
    wide = [_cast(v, torch.float64) if isinstance(v, torch.Tensor) else _in(torch.float32, v) for v in (a, b, c)]
    return _cast(wide[0] * wide[1] + wide[2], torch.float32)


def _chbevl(y, coefficients):
    """The kernels' Chebyshev loop: ``p = q; q = a; a = y * q - p + c`` (``y * q - p``
    fused), then ``0.5 * (a - p)``."""
    p, q, a = 0.0, 0.0, coefficients[0]
    for c in coefficients[1:]:
        p, q = q, a
        a = _fused(y, q, -p) + c
    return 0.5 * (a - p)


def _i0_small(ax):
    """i0 for |x| <= 8, given |x|."""
    return torch.exp(ax) * _chbevl(ax / 2.0 - 2.0, _I0_A)


def _i1_small(ax):
    """i1 for 0 <= x <= 8, given |x|."""
    return _chbevl(ax / 2.0 - 2.0, _I1_A) * ax * torch.exp(ax)


def _beyond_8(ax, coefficients):
    return torch.exp(ax) * _chbevl(_rdiv(32.0, ax) - 2.0, coefficients) / torch.sqrt(ax)


def _i0(x):
    ax = torch.abs(x)
    return torch.where(ax <= 8.0, _i0_small(ax), _beyond_8(ax, _I0_B))


def _i1(x):
    ax = torch.abs(x)
    out = torch.where(ax <= 8.0, _i1_small(ax), _beyond_8(ax, _I1_B))
    return torch.where(x < 0, -out, out)


def _i0e(x):
    """i0(x) * exp(-|x|): the series without the exponential (calc_i0e)."""
    ax = torch.abs(x)
    return torch.where(ax <= 8.0, _chbevl(ax / 2.0 - 2.0, _I0_A),
                       _chbevl(_rdiv(32.0, ax) - 2.0, _I0_B) / torch.sqrt(ax))


def _i1e(x):
    """i1(x) * exp(-|x|) (calc_i1e)."""
    ax = torch.abs(x)
    out = torch.where(ax <= 8.0, _chbevl(ax / 2.0 - 2.0, _I1_A) * ax,
                      _chbevl(_rdiv(32.0, ax) - 2.0, _I1_B) / torch.sqrt(ax))
    return torch.where(x < 0, -out, out)


def _k(x, small, coefficients, scaled):
    """k0/k1: inf at 0, NaN below 0, ``small`` up to 2, the series in 8 / x - 2 beyond."""
    half = _chbevl(_rdiv(8.0, x) - 2.0, coefficients)
    large = half / torch.sqrt(x) if scaled else torch.exp(-x) * half / torch.sqrt(x)
    out = torch.where(x <= 2.0, small, large)
    out = torch.where(x < 0, _full(x, math.nan), out)
    return torch.where(x == 0, _full(x, math.inf), out)


def _k0(x, scaled=False):
    half = _chbevl(_fused(x, x, -2.0), _K0_A)
    if scaled:
        small = _fused(-torch.log(0.5 * x), _i0_small(x), half) * torch.exp(x)
    else:
        # The kernel's log(0.5 * x) is a double (its 0.5 is): the product and the
        # difference are too, rounded to x's dtype at the return.
        log = torch.log(0.5 * _cast(x, torch.float64))
        small = _cast(_fused(-log, _cast(_i0_small(x), torch.float64), _cast(half, torch.float64)), x.dtype)
    return _k(x, small, _K0_B, scaled)


def _k1(x, scaled=False):
    small = _fused(torch.log(0.5 * x), _i1_small(x), _chbevl(_fused(x, x, -2.0), _K1_A) / x)
    return _k(x, small * torch.exp(x) if scaled else small, _K1_B, scaled)


def _scaled_k0(x):
    return _k0(x, scaled=True)


def _scaled_k1(x):
    return _k1(x, scaled=True)


def _horner(z, coefficients):
    """The kernel's ``p = 0; p = p * z + c`` loop (its first step is the first constant)."""
    p = coefficients[0]
    for c in coefficients[1:]:
        p = _fused(z, p, c)
    return p


def _airy_negative(x):
    """x < -2.09: the asymptotic form with sin and cos."""
    w = -2.0 * x * torch.sqrt(-x) / 3.0
    z = _rdiv(1.0, w)
    zz = z * z
    t = w + 0.25 * math.pi
    p = 1.0 + zz * _horner(zz, _AIRY_AFN) / _horner(zz, _AIRY_AFD)
    q = z * _horner(zz, _AIRY_AGN) / _horner(zz, _AIRY_AGD)
    difference = _fused(torch.sin(t), p, -(torch.cos(t) * q))
    return _rdiv(_AIRY_SCALE, torch.sqrt(torch.sqrt(-x))) * difference


def _airy_positive(x):
    """x >= 2.09: the rational function of 1 / zeta times exp(-zeta)."""
    zeta = 2.0 * x * torch.sqrt(x) / 3.0
    r = _rdiv(1.0, zeta)
    ratio = _horner(r, _AIRY_AN) / _horner(r, _AIRY_AD)
    return _AIRY_SCALE * ratio / (2.0 * torch.sqrt(torch.sqrt(x)) * torch.exp(zeta))


def _airy_series(x):
    """|x| < 2.09: the power series f, g in x^3, run while |m / f| > eps."""
    eps = torch.finfo(x.dtype).eps
    z = x * x * x
    m = z / 2.0 / 3.0
    n = x * z / 3.0 / 4.0
    f = 1.0 + m
    g = x + n
    t = torch.abs(m / f)
    for step in range(2, _AIRY_SERIES_STEPS[x.dtype] + 1):
        k = 3.0 * step
        running = t > eps
        m_next = m * z / (k - 1.0) / k
        n_next = n * z / k / (k + 1.0)
        f_next = f + m_next
        m = torch.where(running, m_next, m)
        n = torch.where(running, n_next, n)
        f = torch.where(running, f_next, f)
        g = torch.where(running, g + n_next, g)
        t = torch.where(running, torch.abs(m_next / f_next), t)
    return _fused(f, _AIRY_C1, -(_AIRY_C2 * g))


def _airy_ai(x):
    out = torch.where(x >= 2.09, _airy_positive(x), _airy_series(x))
    out = torch.where(x < -2.09, _airy_negative(x), out)
    out = torch.where(x > 103.892, torch.zeros_like(x), out)
    # abs(x) == inf, not isinf: torch_lib's isinf casts to float32.
    return torch.where(torch.abs(x) == math.inf, _full(x, math.nan), out)


(modified_bessel_i0, modified_bessel_i1, modified_bessel_k0, modified_bessel_k1, scaled_modified_bessel_k0,
 scaled_modified_bessel_k1, airy_ai, i0e, i1e) = (
    _on_float(f) for f in (_i0, _i1, _k0, _k1, _scaled_k0, _scaled_k1, _airy_ai, _i0e, _i1e))


def table() -> dict:
    return {
        aten.special_modified_bessel_i0.default: modified_bessel_i0,
        aten.special_modified_bessel_i1.default: modified_bessel_i1,
        aten.special_modified_bessel_k0.default: modified_bessel_k0,
        aten.special_modified_bessel_k1.default: modified_bessel_k1,
        aten.special_scaled_modified_bessel_k0.default: scaled_modified_bessel_k0,
        aten.special_scaled_modified_bessel_k1.default: scaled_modified_bessel_k1,
        aten.special_airy_ai.default: airy_ai,
        # torch.i0 and torch.special.i0e / i1 / i1e: the same series (calc_i0, calc_i0e,
        # calc_i1, calc_i1e); PyTorch's own decompositions end in prims with no ONNX form.
        aten.i0.default: modified_bessel_i0,
        aten.special_i0e.default: i0e,
        aten.special_i1.default: modified_bessel_i1,
        aten.special_i1e.default: i1e,
    }
