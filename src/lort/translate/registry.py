"""The registry of ATen -> ONNX translations lort uses: torch_lib's (through
``_compat``), with lort's own registered ahead of them: exact float scalars
(``exact_scalars.py``), the orthogonal polynomials as an ONNX Loop (``polynomials.py``),
complex forms torch_lib lacks, on float pairs (``complex_ops.py``), the CPU attention
kernel as ONNX's Attention (``attention.py``)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from . import _compat, attention, complex_ops, exact_scalars, polynomials


@functools.lru_cache(maxsize=1)
def registry() -> Any:
    """The registry (built once; it takes about a second)."""
    reg = _compat.torchlib_registry()
    exact_scalars.register(reg)
    polynomials.register(reg)
    complex_ops.register(reg)
    attention.register(reg)
    return reg


def dispatch(node: torch.fx.Node) -> tuple[Callable | None, str]:
    """The function that translates ``node``, or None and torch_lib's reason. (Whether
    that translation is right is lort.fusion.support's question.)"""
    return _compat.dispatch(node, registry())


def implemented_overloads() -> set:
    """The ATen overloads with a translation. Building them needs the whole registry
    (seconds)."""
    return _compat.implemented_overloads(registry())
