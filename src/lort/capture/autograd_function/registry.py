"""The registry of opaque autograd.Function calls, and the ctx token.

* :class:`_Entry`: one opaque call site of a compiled graph (the Function class, its
  non-tensor arguments with tensors replaced by :class:`_Slot`, input and output metadata).
  ``lort::python_op`` gets only an int handle; :func:`_lookup` turns it back into the entry.
  The registry holds entries weakly: the FX node that calls the op and the compiled
  callable (``LortBackend`` keeps :func:`entries_in`) hold them, so they live as long as
  the compiled graph.
* ``_OPAQUE``: the Function classes Dynamo failed to trace under lort, with the reason.
* The ctx token: a one-element int64 tensor from numpy whose base array carries the real
  ctx of one forward call; AOTAutograd saves it for backward, and when it is freed the
  ctx goes with it.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Any

import numpy as np
import torch

from ...errors import OpaqueFunctionError


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Position ``index`` of the op's tensor list, in a function's argument template."""

    index: int


@dataclasses.dataclass(frozen=True)
class _TensorMeta:
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> "_TensorMeta":
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

    def empty(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)

    def describe(self) -> str:
        return f"{self.dtype} {list(self.shape)} on {self.device}"


class _Entry:
    """One opaque call site of a compiled graph: the Function and its non-tensor args."""

    def __init__(self, fn_cls: type, template: list, in_meta: list[_TensorMeta], needs_grad: tuple[bool, ...]):
        self.fn_cls = fn_cls
        self.template = template  # arguments, tensors replaced by _Slot
        self.in_meta = in_meta
        self.needs_grad = needs_grad  # per tensor input, at capture time
        self.out_meta: list[_TensorMeta] = []
        self.out_spec: Any = None  # outputs.py: ("t", i) | ("c", value) | ("tuple"|"list", [specs])
        self.non_differentiable: set[int] = set()
        self.dirty: dict[int, int] = {}  # output index -> tensor input index
        self.metadata_from = ""  # "fake-tensor run" or "dummy run"
        self.handle = -1

    @property
    def name(self) -> str:
        return f"{self.fn_cls.__module__}.{self.fn_cls.__qualname__}"

    def args(self, tensors: list) -> list:
        return [tensors[a.index] if isinstance(a, _Slot) else a for a in self.template]


_ENTRIES: "weakref.WeakValueDictionary[int, _Entry]" = weakref.WeakValueDictionary()
_handles = itertools.count(1)
#: Function classes Dynamo failed to trace under lort -> the reason (they run opaquely).
_OPAQUE: "weakref.WeakKeyDictionary[type, str]" = weakref.WeakKeyDictionary()


def register(entry: _Entry) -> int:
    """Gives ``entry`` a handle and registers it (weakly); returns the handle."""
    entry.handle = next(_handles)
    _ENTRIES[entry.handle] = entry
    return entry.handle


def opaque_functions() -> dict[type, str]:
    """autograd.Function classes lort runs opaquely, with the reason Dynamo gave."""
    return dict(_OPAQUE)


def _lookup(handle: int) -> _Entry:
    entry = _ENTRIES.get(handle)
    if entry is None:
        raise OpaqueFunctionError(
            f"lort: opaque autograd.Function call {handle} is no longer registered; the compiled "
            f"graph that used it was freed (torch._dynamo.reset()?) while its code still ran"
        )
    return entry


def entries_in(gm: torch.fx.GraphModule) -> list[_Entry]:
    """The opaque-call entries a Dynamo graph uses; the compiled callable keeps them alive."""
    return [n.meta["lort_python_op"] for n in gm.graph.nodes if "lort_python_op" in n.meta]


# -- the ctx token -------------------------------------------------------------------------


class _CtxHolder(np.ndarray):
    """A one-element int64 array (the token's storage) that carries the real ctx."""

    state: Any


_LIVE: "weakref.WeakValueDictionary[int, _CtxHolder]" = weakref.WeakValueDictionary()
_keys = itertools.count(1)


def _new_token(state: Any) -> torch.Tensor:
    key = next(_keys)
    holder = np.full(1, key, dtype=np.int64).view(_CtxHolder)
    holder.state = state
    _LIVE[key] = holder
    return torch.from_numpy(holder)


def _token_state(token: torch.Tensor) -> Any:
    """The state :func:`_new_token` stored, or None once the token was freed."""
    holder = _LIVE.get(int(token[0]))
    return None if holder is None else holder.state
