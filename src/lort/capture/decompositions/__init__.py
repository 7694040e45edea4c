"""The decomposition table lort traces with (``table``), and the package of lort's own
decompositions, one module per kind of op.

Start from PyTorch's own decompositions of exactly the ops torch_lib cannot translate
(``_compat.decomposition_table``, given the support checker's
``implemented_overload_names``), then add the ones that keep backward graphs in ORT:

* attention is traced in its math form (``capture.aot`` selects PyTorch's math SDPA
  backend while tracing), because the fused CPU kernel's backward has no ONNX
  translation while the math form's backward is matmuls and softmax.
* ``convolution_backward`` (no PyTorch decomposition, no torch_lib translation) can be
  written as the convolutions that compute it (``composite``). It is off by default
  (``Options.decompose_conv_backward``): ORT's Conv with a kernel as large as the
  feature map is slow (benchmarks/studies/conv_backward.md).
* ``_transformer_encoder_layer_fwd``, nn.TransformerEncoderLayer's inference fast path
  (no torch_lib translation), is written as the attention, feed-forward and layer
  norms it computes (``composite``); with an attention mask it stays whole (runs in
  PyTorch).
* ``embedding_dense_backward`` is kept whole and runs in PyTorch's kernel (no torch_lib
  translation). PyTorch's decomposition is a scatter-add into zeros of the embedding
  table's size, which ORT's constant folding turned into an initializer every backward
  session held for good (BERT-base: 89 MiB; a 32k x 4096 vocabulary: 500 MiB).
* ``native_batch_norm_backward`` in training (batch statistics) is kept whole and runs in
  PyTorch's fused kernel (no torch_lib translation). Its decomposition, a dozen elementwise
  ops and reductions per layer, ran 9x eager's kernel in ORT (ResNet-50's backward on an
  Intel Xeon: 405 + 24 ms against 48 ms, benchmarks/studies/backward_breakdown.md); kept whole,
  a ResNet-50 training step with every group in ORT is 1.11x faster (3014 against
  3333 ms, batch 8 at 224 px).
  Layer norm's, softmax's and GELU's backward stay decomposed: kept whole, BERT-base's
  step (batch 4 x 128) was 0.99x / 1.00x / 1.00x as fast, so no gain pays for the
  boundary between ORT groups (benchmarks/studies/fused_backward.md).
* ``native_dropout`` on CPU in training: its mask drawn by one random op with no tensor
  input (``lort::dropout_mask``, in PyTorch, eager's draw bit for bit) and the products in
  ORT, so dropouts no longer cut a training forward into one ORT group each (``dropout``).
* integer ``div(..., rounding_mode="floor")`` becomes ``floor_divide`` (``composite``).
* NaN semantics: amax/amin/max/min, argmax/argmin, max_pool and sign get an isnan-based
  select after the op, so ORT's results follow PyTorch's on inputs with NaN (``nan``).
* single ops whose translation fails on some inputs (reductions of 0-d tensors, ...):
  ``ops``.
* indexing ops torch_lib has no translation for (searchsorted, diagonal_scatter,
  index_reduce, cummax/cummin): ``indexing``.
* lgamma, digamma and polygamma (no ONNX op) as PyTorch's CPU algorithms in elementwise
  ops: ``special``; Bessel j0, j1, y0, y1 and spherical j0:
  ``bessel``; modified Bessel i0, i1, k0, k1, scaled k0, k1 and Airy Ai:
  ``bessel_modified``.
* linalg_solve_triangular and triangular_solve as substitution steps, lu_unpack as masks
  and row swaps: ``linalg``.
* ops on dtypes ORT has no kernel for (integer inputs of float-only unary ops, int64
  addmm, float64 and int64 convolution, float64 average pooling): ``kernels``.
* float floor division and remainder from fmod, integer truncating division, fmax/fmin:
  ``rounding``; erf (float64), erfc, erfcx, ndtri, erfinv and log_ndtr:
  ``erf``; expm1, elu/celu/selu, sigmoid/silu/glu, softplus and mish
  where ORT's kernel is not accurate at small values: ``exponential``.
"""

from __future__ import annotations

import functools
import math

import torch

from ...fusion import support
from ...translate import _compat
from . import bessel, bessel_modified, dropout, erf, exponential, indexing, kernels, linalg, nan, ops, rounding, special
from .composite import convolution_backward, div_floor_integer, transformer_encoder_layer_fwd

aten = torch.ops.aten


def copysign(a, b):
    """copysign as ``where(signbit(b), -|a|, |a|)`` with aten.signbit. PyTorch's own
    decomposition uses prims.signbit, whose fake tensor is float32 where the real one is
    bool, so the ORT group it feeds was built for a float input and failed at run time."""
    dtype = torch.result_type(a, b)
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    magnitude = torch.abs(a.to(dtype))
    if not isinstance(b, torch.Tensor):
        return torch.neg(magnitude) if math.copysign(1.0, b) < 0 else magnitude
    return torch.where(torch.signbit(b), torch.neg(magnitude), magnitude)


#: Ops PyTorch decomposes that lort keeps whole, to run in PyTorch's kernel (the package's
#: docstring says why each; batch norm's backward is kept whole in training only, below).
KEPT_WHOLE = (aten.embedding_dense_backward.default,)


def _batch_norm_backward_in_training(decomposition):
    """native_batch_norm_backward kept whole where it normalized by the batch's statistics
    (``train``): PyTorch's fused kernel. In eval mode its decomposition is a scale and a
    sum that ORT runs with its neighbours, and the whole op would need the forward's saved
    statistics, which the inference forward gives as empty tensors (ORT cannot)."""

    def decompose(*args, **kwargs):
        train = kwargs["train"] if "train" in kwargs else args[7]  # the schema's eighth argument
        if train:
            return NotImplemented  # the tracer keeps the op
        return decomposition(*args, **kwargs)

    return decompose


@functools.lru_cache(maxsize=4)
def table(decompose_conv_backward: bool = False, implemented: tuple[str, ...] | None = None) -> dict:
    """The decomposition table AOTAutograd traces with: PyTorch's decompositions of the
    ops torch_lib does not translate correctly (``implemented`` names those it does; the
    support checker's ``implemented_overload_names()`` when None), plus lort's."""
    if implemented is None:
        implemented = support.implemented_overload_names()
    decomps = dict(_compat.decomposition_table(implemented))
    # Decompositions that break tracing: lift_fresh's turns a torch.tensor() constant
    # into an alias of a real tensor inside FakeTensorMode; diagonal_scatter's and
    # as_strided_scatter's (torch._refs) emit prims.copy_to, which AOTAutograd rejects as
    # not functional. Without them the ops stay whole (diagonal_scatter then gets lort's
    # own, indexing's).
    for op in (aten.lift_fresh.default, aten.diagonal_scatter.default, aten.as_strided_scatter.default):
        decomps.pop(op, None)
    # An embedding's and a batch norm's backward stay whole, in PyTorch (the package's docstring).
    for op in KEPT_WHOLE:
        decomps.pop(op, None)
    bn_backward = aten.native_batch_norm_backward.default
    if bn_backward in decomps:
        decomps[bn_backward] = _batch_norm_backward_in_training(decomps[bn_backward])
    if decompose_conv_backward:
        decomps[aten.convolution_backward.default] = convolution_backward
    decomps[aten._transformer_encoder_layer_fwd.default] = transformer_encoder_layer_fwd
    decomps[aten.div.Tensor_mode] = div_floor_integer
    decomps[aten.div.Scalar_mode] = div_floor_integer
    decomps.update(nan.nan_decompositions())
    decomps[aten.copysign.Tensor] = copysign
    decomps[aten.copysign.Scalar] = copysign
    decomps.update(ops.table(decomps))
    decomps.update(indexing.table())
    decomps.update(special.table())
    decomps.update(bessel.table())
    decomps.update(bessel_modified.table())
    decomps.update(linalg.table())
    decomps.update(dropout.table())
    for op, fn in {**kernels.table(), **rounding.table()}.items():
        decomps[op] = ops.chain(fn, decomps.get(op))
    for op, fn in {**erf.table(), **exponential.table()}.items():
        decomps[op] = ops.chain(fn, decomps.get(op))
    return decomps
