"""Frozen weights at run time: the cheap check, on every call, that the parameters and
buffers a session holds as ORT initializers are still what was frozen.

A weight has changed when the tensor passed is another object, points at other memory
(``p.data = t``), or has a newer version counter (every in-place op through the tensor
or its views: ``p.mul_``, ``p.copy_``, optimizer steps, ``load_state_dict``, buffer
updates). Writes through ``p.data`` or NumPy bump no version counter; with
``sample=True`` (Options.freeze="auto") one element of each CPU tensor, its largest in
magnitude when frozen, is compared too, which catches writes that change it (scaling,
zeroing, copying other values in); a write that leaves that element as it was is not
seen (use ``freeze=False`` for code that writes weights that way)."""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import threading
from typing import Callable, Sequence

import numpy as np
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily


_timing = threading.local()


@contextlib.contextmanager
def timing_runs():
    """Calls made to time a compiled graph (compile/tuner.py) run on clones of its
    inputs and their outputs are discarded: in them the frozen sessions are used as
    they are, not frozen again over the clones."""
    before = getattr(_timing, "on", False)
    _timing.on = True
    try:
        yield
    finally:
        _timing.on = before


def in_timing_run() -> bool:
    return getattr(_timing, "on", False)


@dataclasses.dataclass(frozen=True)
class FrozenWeight:
    """A group input frozen into its sessions: its position among the group's inputs,
    its readable name ("encoder.layer.0.weight") and the tensor frozen (None once the
    runtime holds it: the guard keeps the current one)."""

    index: int
    name: str
    tensor: torch.Tensor | None


class WeightGuard:
    """Tells whether any frozen weight changed since ``reset``."""

    def __init__(self, weights: tuple[FrozenWeight, ...], sample: bool):
        self.indices = [w.index for w in weights]
        # The frozen inputs out of a call's arguments, as a tuple (in C).
        self._pick = picker(self.indices)
        self.names = [w.name for w in weights]
        self.sample = sample
        #: Calls since ``reset`` (a weight that changes on the call right after being
        #: frozen again changes on every call: runtime/group.py then unfreezes it).
        self.calls_since_reset = 0
        self.reset([w.tensor for w in weights])

    def reset(self, tensors: list[torch.Tensor]) -> None:
        """Take ``tensors`` (one per frozen weight, in order) as the frozen state."""
        self.tensors = list(tensors)
        self.versions = [t._version for t in tensors]
        self.ptrs = [t.data_ptr() for t in tensors]
        self.calls_since_reset = 0
        # Sampled elements: position in weights, reader (a memoryview or NumPy view over
        # the weight's memory), index into it, value when frozen.
        self._sampled, self._views, self._where, self._values = [], [], [], []
        if self.sample:
            with unset_fake_temporarily():  # built while compiling, under FakeTensorMode
                self._take_samples(tensors)

    def _take_samples(self, tensors: list[torch.Tensor]) -> None:
        for k, t in enumerate(tensors):
            probe = _sample(t)
            if probe is not None:
                self._sampled.append(k)
                self._views.append(probe[0])
                self._where.append(probe[1])
                self._values.append(probe[2])

    def same(self, args) -> bool:
        """Whether no frozen weight changed (``args``: the group's inputs)."""
        return self.same_picked(self._pick(args))

    def same_picked(self, picked) -> bool:
        """Whether no frozen weight changed (``picked``: the frozen inputs, in order). The
        common case, decided by C-level maps (about 0.1 us a weight)."""
        return (
            all(map(operator.is_, picked, self.tensors))
            and list(map(_VERSION, picked)) == self.versions
            and list(map(_DATA_PTR, picked)) == self.ptrs
            and list(map(operator.getitem, self._views, self._where)) == self._values
        )

    def changed(self, args) -> str | None:
        """The name of the first frozen weight that changed (``args``: the group's
        inputs), or None."""
        if self.same(args):
            return None
        picked = self._pick(args)
        for k, a in enumerate(picked):
            if a is not self.tensors[k] or a._version != self.versions[k] or a.data_ptr() != self.ptrs[k]:
                return self.names[k]
        for k, view, index, value in zip(self._sampled, self._views, self._where, self._values):
            if view[index] != value:
                return self.names[k]
        return None


def picker(indices: list[int]) -> Callable[[Sequence], tuple]:
    """``operator.itemgetter(*indices)`` (in C), always giving a tuple."""
    if len(indices) == 1:
        i = indices[0]
        return lambda a: (a[i],)
    return operator.itemgetter(*indices) if indices else (lambda a: ())


_VERSION = operator.attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr


#: Floating dtypes are sampled through an integer view of their bits: exact, NaN-safe,
#: and readable by a memoryview (which cannot index float16 or bfloat16).
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}


def _sample(t: torch.Tensor):
    """(reader over ``t``'s memory, index, value) of its largest finite element in
    magnitude (the first where none is finite, or of a bool tensor), or None for a tensor
    that cannot be read cheaply (not in CPU memory, empty, not strided, complex). The
    value is the element's bits for floating dtypes. The reader is a flat memoryview
    (indexing it is about twice as fast as indexing NumPy), or the NumPy view with a
    tuple index where the tensor is not contiguous."""
    if t.device.type != "cpu" or t.numel() == 0 or t.layout != torch.strided or t.is_complex():
        return None
    d = t.detach()
    flat = 0
    if d.is_floating_point():
        magnitude = d.abs() if d.dtype in (torch.float32, torch.float64) else d.abs().float()
        flat = int(torch.where(torch.isfinite(magnitude), magnitude, -1).reshape(-1).argmax())
        d = d.view(_BITS[d.dtype])
    elif d.dtype != torch.bool:
        flat = int(d.abs().reshape(-1).argmax()) if d.is_signed() else int(d.reshape(-1).argmax())
    view = d.numpy()
    if view.flags.c_contiguous:
        reader = memoryview(view.reshape(-1))
        return reader, flat, reader[flat]
    index = np.unravel_index(flat, view.shape)
    return view, index, view[index].copy()
