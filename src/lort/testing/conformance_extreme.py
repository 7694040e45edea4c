"""The extreme-value sample of the OpInfo conformance sweep (lort.testing.conformance).

OpInfo's samples never reach extreme values: their values are small and finite. After the
ordinary samples of an op, for float dtypes, the sweep runs one more: an op's sample whose
floating tensors keep their shapes but hold a fixed cycle of extreme values (signed
zeros, denormal-scale and overflow-scale magnitudes, infinities, NaN). Only outputs are
compared on it (the gradients of inf and NaN are noise), with the same tolerances and
``equal_nan=True``. Integer and bool tensors (indices, masks) are left as they are.

``KNOWN_DIFFERENCES`` lists the ops whose difference on this sample is PyTorch's own
kernel in overflow territory or an input outside the op's domain, not a translation that
differs from PyTorch's semantics; the sweep reports them apart, not as wrong.
"""

from __future__ import annotations

import math

import torch

#: Infinities and NaN come early, so that small tensors (a 3 x 3 matrix) hold them too.
_FLOAT32_VALUES = (
    0.0, -0.0, math.inf, -math.inf, math.nan, 1e-30, -1e-30, 1.0, -1.0, 88.0, -88.0, 500.0, -500.0, 3e38, -3e38,
)
#: The cycle of values per dtype: float64 adds what overflows exp (710), underflows it
#: (-750), a denormal (1e-310) and 1e300, whose square overflows.
VALUES = {
    torch.float32: _FLOAT32_VALUES,
    torch.float64: _FLOAT32_VALUES + (1e300, 710.0, -750.0, 1e-310),
}
#: Step through the cycle of the k-th floating tensor: coprime with both cycle lengths
#: (15 and 19), so that over n * n elements two tensors meet in every pair of values.
_STEPS = (1, 2, 4, 7, 8, 11, 13, 14)
#: How many of the op's samples are looked at to pick the one to fill.
CANDIDATES = 8

_FMA = (
    "ORT's MLAS GEMM accumulates with fused multiply-adds, so a product that overflows on "
    "its own (float32 3e38 * -500, float64 1e300 * 1e300) never reaches inf before it meets "
    "an infinite term; PyTorch's BLAS rounds it to inf first, and inf + -inf is NaN in eager, "
    "-inf in lort (overflow territory of MatMul, a kernel the benchmark models depend on)"
)
_DECOMPOSITION = (
    "PyTorch's own decomposition of the op, which lort runs (as inductor would), gives the "
    "same result as lort; only eager's C++ kernel differs"
)
_VECTORIZED_FMOD_REMAINDER = (
    "PyTorch's vectorized remainder starts from its vectorized fmod, x - trunc(x / y) * y, "
    "NaN when x / y overflows (remainder(3e38, 1e-30)); lort computes it from the exact "
    "fmod (ORT's Mod), as PyTorch's own scalar path does (the same inputs at the end of a "
    "tensor, past the last full vector, give lort's value in eager)"
)
_INTERPOLATION = (
    f"{_DECOMPOSITION}: it weights both neighbours of every output point, so an infinite "
    "neighbour with weight 0 gives inf * 0 = NaN, where eager's kernel skips that neighbour"
)
_WELFORD = (
    f"{_DECOMPOSITION}: eager's mean and rstd come from Welford updates, which give NaN for a "
    "group holding an infinity (inf - inf); the decomposition sums and gives inf or -inf"
)
_MARGIN = (
    f"{_DECOMPOSITION}: eager's kernel adds a term only when it is > 0, which drops NaN terms "
    "(of inf - inf); the decomposition's clamp_min(0) keeps them"
)
#: (OpInfo name, dtype name or None for every dtype) -> why the extreme sample differs
#: from eager for a reason that is not a lort translation at odds with PyTorch's
#: semantics: PyTorch's kernel in overflow territory, or an input outside the op's domain.
#: Only differences the sweep shows are listed (benchmarks/results/conformance.md, "Extreme-value
#: samples", names others seen with another order of the values).
KNOWN_DIFFERENCES: dict[tuple[str, str | None], str] = {
    **{(name, dtype): _FMA for name in ("bmm", "baddbmm", "nn.functional.linear") for dtype in ("float32", "float64")},
    ("matmul", "float32"): _FMA,
    **{(name, "float32"): (
        f"{_DECOMPOSITION}: eager's kernel computes a1 * b2 - a2 * b1 with a fused multiply-add, "
        "so a product that overflows alone (3e38 * 500) does not (-inf where lort has inf - inf)"
    ) for name in ("cross", "linalg.cross")},
    ("nn.functional.interpolate.linear", None): _INTERPOLATION,
    ("nn.functional.conv_transpose3d", "float32"): (
        "sums of 3e38-scale products overflow to inf or not by their order of summation, "
        "which differs between ORT's ConvTranspose and PyTorch's kernel (overflow territory)"
    ),
    ("fmod", None): (
        "PyTorch's vectorized fmod computes x - trunc(x / y) * y, NaN when x / y overflows "
        "(fmod(3e38, 1e-30)); ORT gives the exact remainder, as std::fmod and PyTorch's own "
        "scalar path do"
    ),
    ("remainder", None): _VECTORIZED_FMOD_REMAINDER,
    ("__rmod__", None): _VECTORIZED_FMOD_REMAINDER,
    ("nn.functional.hardswish", "float32"): (
        "PyTorch's hardswish of |x| > 5.7e37 overflows inside its kernel (x * (x + 3) / 6); "
        "ORT gives the finite value"
    ),
    ("nn.functional.interpolate.bilinear", None): _INTERPOLATION,
    ("nn.functional.interpolate.trilinear", None): _INTERPOLATION,
    ("nn.functional.upsample_bilinear", None): _INTERPOLATION,
    ("nn.functional.instance_norm", None): _WELFORD,
    ("nn.functional.multi_margin_loss", None): _MARGIN,
    ("nn.functional.multilabel_margin_loss", None): _MARGIN,
    ("_softmax_backward_data", None): (
        f"{_DECOMPOSITION}; its output argument must be a softmax (values in [0, 1]), and "
        "with 88 and 3e38 there the products overflow in another order"
    ),
    ("grid_sampler_2d", "float32"): (
        "sampling coordinates out of the op's domain: NaN, inf or beyond 2**31 pixels; "
        "ORT's GridSample converts them to indices that overflow, PyTorch's kernel gives "
        "NaN or the padding"
    ),
    ("nn.functional.grid_sample", "float32"): (
        "sampling coordinates NaN, inf or beyond 2**31 pixels (see grid_sampler_2d)"
    ),
    **{(f"special.{name}", None): (
        "x NaN with n >= 2: PyTorch's kernel stops its recurrence on the NaN before the first "
        "step and returns an uninitialized variable (eager gives -inf, 0 or a denormal, "
        "whatever the register held); lort gives NaN (lort/translate/polynomials.py)"
    ) for name in ("chebyshev_polynomial_u", "chebyshev_polynomial_w", "shifted_chebyshev_polynomial_t",
                   "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_w", "laguerre_polynomial_l",
                   "legendre_polynomial_p")},
}

_DFT = (
    "a discrete Fourier transform of a sequence holding inf or NaN: each output sums every "
    "input times a twiddle factor; ORT's DFT multiplies by every factor, 0 and the DC term's "
    "included, so an infinite input gives inf * 0 = NaN where pocketfft, eager's kernel, "
    "skips the trivial factors and leaves an exact 0 (the imaginary part of a real input's "
    "DC term) or one infinity (outputs whose every term meets infinities of one sign)"
)
KNOWN_DIFFERENCES.update({
    (name, None): _DFT
    for name in ("fft.fft", "fft.fft2", "fft.fftn", "fft.hfft", "fft.hfft2", "fft.hfftn", "fft.ifft", "fft.ifft2",
                 "fft.ifftn", "fft.ihfft", "fft.ihfft2", "fft.ihfftn", "fft.irfft", "fft.irfft2", "fft.irfftn",
                 "fft.rfft", "fft.rfft2", "fft.rfftn", "stft", "istft")
})

#: Unary elementwise ops whose eager value on extreme inputs depends on the CPU: their
#: extreme sample's eager reference is computed one element at a time (PyTorch's scalar
#: path, the same on every x86-64 CPU), and lort must match that.
PER_ELEMENT_REFERENCE: dict[str, str] = {
    "nn.functional.gelu": (
        "float32 gelu runs oneDNN's kernel, which gives NaN for +inf on AVX-512 CPUs and inf "
        "(the limit, as PyTorch's scalar path) on AVX2 ones"
    ),
}

#: Ops whose extreme sample is not run: eager PyTorch itself crashes the process on it.
EAGER_CRASHES: dict[str, str] = {
    "linalg.eigvals": "eager PyTorch segfaults on NaN/inf input (MKL's sgebal rejects it)",
}


def values(dtype: torch.dtype) -> tuple[float, ...]:
    """The extreme values of a dtype's cycle (float32's for other floating dtypes)."""
    return VALUES.get(dtype, _FLOAT32_VALUES)


def _floating(leaf) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dtype.is_floating_point


def _size(leaves: list) -> tuple[int, int]:
    sizes = [x.numel() for x in leaves if _floating(x)]
    return (min(sizes), sum(sizes)) if sizes else (0, 0)


def pick(leaves_per_sample: list[list]) -> int | None:
    """Which sample to fill: the one whose smallest floating tensor is largest (then the
    most floating elements), so that binary ops meet many pairs of values; None when no
    sample has a non-empty floating tensor."""
    best, best_size = None, (0, 0)
    for i, leaves in enumerate(leaves_per_sample):
        size = _size(leaves)
        if size[0] > 0 and size > best_size:
            best, best_size = i, size
    return best


def fill(leaves: list) -> list:
    """``leaves`` with each floating tensor replaced by one of the same shape and dtype
    holding the cycle of extreme values (not requiring grad); other leaves as they are."""
    out, k = [], 0
    for leaf in leaves:
        if not _floating(leaf):
            out.append(leaf)
            continue
        cycle = torch.tensor(values(leaf.dtype), dtype=torch.float64)
        n, i = len(cycle), torch.arange(leaf.numel())
        index = (_STEPS[k % len(_STEPS)] * (i % n) + i // n) % n
        out.append(cycle[index].to(leaf.dtype).reshape(leaf.shape))
        k += 1
    return out


def per_element(fn):
    """``fn`` (a unary elementwise op of one tensor) run one element at a time."""

    def call(t: torch.Tensor) -> torch.Tensor:
        flat = t.reshape(-1)
        return torch.cat([fn(flat[i:i + 1].clone()) for i in range(flat.numel())]).reshape(t.shape)

    return call


def known_difference(name: str, dtype_name: str) -> str | None:
    return KNOWN_DIFFERENCES.get((name, dtype_name)) or KNOWN_DIFFERENCES.get((name, None))
