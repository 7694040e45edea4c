"""Dropout on CPU as a random mask drawn apart from its arithmetic.

``native_dropout`` is a random op, so it runs in PyTorch (its results follow PyTorch's
RNG). Kept whole, each dropout sat between its producer and its consumer, and a
transformer's training forward was cut into one ORT group per dropout (BERT-base: 38
groups for 37 dropouts, each boundary a copy, a lost fusion, and an ORT run that starts
beside PyTorch's spinning OpenMP workers).

PyTorch's CPU kernel draws the mask from the input's shape and dtype alone
(``empty_like(input).bernoulli_(1 - p)``) and then computes ``input * (mask * scale)``. So
the draw is written here as one op with no tensor input, ``lort::dropout_mask`` (tagged
random: it stays in PyTorch), and the products as plain ops that join the ORT group
around them. The mask depends on no value of the graph, so it runs before the group that
uses it: the groups are no longer cut. Masks are drawn in the graph's order, as eager
draws them (the fuser keeps random ops in their order, ``fusion/dependencies.py``), so
the output and the mask are eager's bit for bit.

Left whole: CUDA (its fused kernel draws differently), symbolic shapes (the sizes would
be read from the input in PyTorch, which cuts the group again), evaluation, and p of 0
or 1.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

_LIB = torch.library.Library("lort", "FRAGMENT")
_LIB.define("dropout_mask(int[] size, float keep, ScalarType dtype, Device device) -> Tensor",
            tags=(torch.Tag.nondeterministic_seeded,))


def _dropout_mask(size, keep, dtype, device):
    """The mask PyTorch's CPU native_dropout draws for an input of ``size`` and ``dtype``
    (bool, as native_dropout returns it)."""
    return torch.empty(size, dtype=dtype, device=device).bernoulli_(keep).to(torch.bool)


def _dropout_mask_fake(size, keep, dtype, device):
    return torch.empty(size, dtype=torch.bool, device=device)


_LIB.impl("dropout_mask", _dropout_mask, "CompositeExplicitAutograd")
torch.library.register_fake("lort::dropout_mask", _dropout_mask_fake, lib=_LIB)

dropout_mask = torch.ops.lort.dropout_mask.default


def _kept_from_aot_cse() -> bool:
    """AOTAutograd's CSE (``fx_graph_cse``) leaves alone the random ops of a list it
    holds, not ops tagged random: two masks of the same shape and p would become one.
    The mask op joins that list; where the list is not found, dropout stays whole."""
    try:
        from torch._functorch import compile_utils

        ops = compile_utils.rand_ops
    except (ImportError, AttributeError):
        return False
    if not isinstance(ops, list):
        return False
    if torch.ops.lort.dropout_mask not in ops:
        ops.append(torch.ops.lort.dropout_mask)
    return True


_SAFE = _kept_from_aot_cse()


def native_dropout(input, p, train):
    """``native_dropout`` on a CPU tensor of static shape in training, as a drawn mask
    and ``input * (mask * scale)``; NotImplemented (kept whole) otherwise."""
    if not _SAFE or not train or not 0.0 < p < 1.0 or input.device.type != "cpu" or not input.dtype.is_floating_point:
        return NotImplemented
    if not all(isinstance(s, int) for s in input.shape):
        return NotImplemented
    keep = 1.0 - p
    mask = dropout_mask(list(input.shape), keep, input.dtype, input.device)
    # eager scales the mask in the input's dtype, then multiplies (in float16 and bfloat16
    # that rounds the scale first; ``(input * mask) * scale`` differed there by an ulp)
    return input * (mask.to(input.dtype) * (1.0 / keep)), mask


def table() -> dict:
    return {aten.native_dropout.default: native_dropout}
