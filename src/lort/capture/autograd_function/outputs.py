"""The structure of an opaque autograd.Function's outputs: recorded at capture, checked at run time.

:func:`spec_of` records what ``forward`` returned at capture time as a spec:
``("t", i)`` the i-th output tensor, ``("c", value)`` a Python scalar, str or None,
``("tuple" | "list", [specs])`` a plain tuple or list. :func:`tensors_of` takes the tensors
out of the real result at run time and checks it against the spec and the output
metadata (:class:`OpaqueFunctionError` on a mismatch). ``dynamo_patch.py`` rebuilds the
spec as Dynamo variables.

Why not ``lort.module.io``'s ``flatten``/``unflatten`` (the ORTModule codec):

* Its leaves are wider than this op can return. io's spec admits dicts, namedtuples,
  dataclasses, ModelOutput and any hashable object as a constant, and it flattens every
  tuple subclass without ``_fields`` (``torch.Size``, ``torch.return_types.max`` on torch
  2.13) as a plain ``"tuple"``. Here the spec is rebuilt mid-trace into Dynamo variable
  trackers, which lort builds only for tensors, Python scalars, plain tuples and plain
  lists; anything else must be refused at capture, naming its type. With io's spec a
  ``torch.Size`` or ``torch.return_types`` result would silently come back a tuple.
* Its check is equality of whole specs; this one runs at every call of the op and names
  the output that changed (a tensor that became something else, a constant's new value,
  a tensor's dtype, device or concrete shape against the capture's metadata).
* io's errors are ORTModule's (``UnsupportedInputError`` about inputs); these are
  :class:`OpaqueFunctionError` naming the function and how its metadata was found.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import OpaqueFunctionError
from .registry import _Entry


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - objects with odd __eq__
        return a is b


def spec_of(value: Any, tensors: list) -> Any:
    """The spec of ``value``; its tensors are appended to ``tensors`` in spec order."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return ("t", len(tensors) - 1)
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return ("tuple" if isinstance(value, tuple) else "list", [spec_of(v, tensors) for v in value])
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("c", value)
    raise OpaqueFunctionError(f"returns a {type(value).__name__}; lort supports tensors, scalars and tuples of them")


def tensors_of(entry: _Entry, result: Any) -> list[torch.Tensor]:
    """The tensors of ``result`` in spec order, checked against ``entry``'s spec and metadata."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any, spec: Any) -> None:
        kind = spec[0]
        if kind == "t":
            if not isinstance(value, torch.Tensor):
                _mismatch(entry, f"output {spec[1]} is {type(value).__name__}, was a tensor at capture")
            tensors.append(value)
        elif kind == "c":
            if not _same_constant(value, spec[1]):
                _mismatch(entry, f"returned {value!r} where capture saw {spec[1]!r}")
        else:
            if not isinstance(value, (tuple, list)) or len(value) != len(spec[1]):
                _mismatch(entry, f"output structure changed (got {type(value).__name__})")
            for v, s in zip(value, spec[1]):
                walk(v, s)

    walk(result, entry.out_spec)
    for i, (t, m) in enumerate(zip(tensors, entry.out_meta)):
        concrete = all(isinstance(s, int) for s in m.shape)
        if t.dtype != m.dtype or t.device != m.device or (concrete and tuple(t.shape) != m.shape):
            _mismatch(entry, f"output {i} is {t.dtype} {list(t.shape)} on {t.device}, capture saw {m.describe()}")
    return tensors


def _mismatch(entry: _Entry, what: str) -> None:
    raise OpaqueFunctionError(
        f"lort runs autograd.Function {entry.name} opaquely and took its output metadata from a "
        f"{entry.metadata_from} at capture time, but at run time it {what}. Outputs whose shape, "
        f"dtype or structure depends on data cannot be compiled; run the function outside the "
        f"compiled region (torch.compiler.disable) or make its outputs' metadata static."
    )
