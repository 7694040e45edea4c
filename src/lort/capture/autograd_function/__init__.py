"""Custom ``torch.autograd.Function`` support under lort (ORTModule's PythonOp/PythonOpGrad).

Traceable functions need nothing from here: Dynamo inlines their forward and custom
backward into the graph and their ops join ORT groups like any other.

A function Dynamo cannot trace (``.item()``, numpy, data-dependent Python, side effects,
collectives, ...) would make Dynamo break the graph. Under a lort backend it becomes one
opaque node of the single graph instead. The package, one job a file, lowest first:

* ``state.py``: whether lort is capturing (``lort.is_capturing()``, :func:`capturing`).
* ``registry.py``: the registry of opaque call sites (the Function class, its non-tensor
  arguments, metadata; the op carries only an int handle), the Function classes that run
  opaquely, and the ctx token that carries the real ctx from forward to backward.
* ``outputs.py``: the structure of a function's outputs, recorded at capture and checked
  at run time (and why it is not ``lort.module.io``'s codec).
* ``meta.py``: output metadata at capture time (a fake-tensor run, else a dummy run).
* ``ops.py``: ``lort::python_op`` and ``lort::python_op_backward`` and their autograd.
* ``dynamo_patch.py``: the wrap of Dynamo's ``AutogradFunctionVariable.call_apply`` that
  emits the op; the only module that touches Dynamo internals (version-dependent).

The names below are the package's interface (``LortBackend`` uses :func:`entries_in`,
:func:`capturing` and :func:`install`; ``distributed.py`` :func:`is_lort_compiler`).
``unavailable_reason`` is read live from ``dynamo_patch``, which owns that state.
"""

from __future__ import annotations

from typing import Any

from ...errors import OpaqueFunctionError
from . import dynamo_patch, ops  # noqa: F401 - ops: importing it registers the custom ops
from .dynamo_patch import (
    BACKEND_MARKER,
    MIN_TORCH,
    _resolve_kwargs,
    check_torch_internals,
    install,
    is_lort_compiler,
)
from .meta import infer_outputs
from .registry import _ENTRIES, entries_in, opaque_functions
from .state import capturing, is_capturing

__all__ = ["is_capturing", "capturing", "install", "entries_in", "OpaqueFunctionError", "opaque_functions"]

#: dynamo_patch's module state, read through the package (never copied at import).
_PATCH_STATE = ("unavailable_reason", "_installed")


def __getattr__(name: str) -> Any:
    if name in _PATCH_STATE:
        return getattr(dynamo_patch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
