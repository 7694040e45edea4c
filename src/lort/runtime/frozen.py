"""Frozen weights at run time: the cheap check, on every call, that the parameters and
buffers a session holds as ORT initializers are still what was frozen.

A weight has changed when the tensor passed is another object, points at other memory
(``p.data = t``), or has a newer version counter (every in-place op through the tensor
or its views: ``p.mul_``, ``p.copy_``, optimizer steps, ``load_state_dict``, buffer
updates). Writes through ``p.data`` or NumPy bump no version counter; with
``sample=True`` (Options.freeze="auto") one element of each CPU tensor, its largest in
magnitude when frozen, is compared too, which catches writes that change it (scaling,
zeroing, copying other values in); a write that leaves that element as it was is not
seen (use ``freeze=False`` for code that writes weights that way).

The check runs in C++ where runtime/native.py's module is built (the same test, several
times faster right after an ORT run, when the tensors are out of the caches), else in
Python."""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import sys
import threading
from typing import Callable, Sequence

import numpy as np
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..numpy_views import numpy_view
from . import native, offload


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
        # Where each frozen weight is read on a call (``register``), or None.
        self._registries: tuple[list[dict], list] | None = None
        self.reset([w.tensor for w in weights])

    def reset(self, tensors: list[torch.Tensor]) -> None:
        """Take ``tensors`` (one per frozen weight, in order) as the frozen state."""
        self.tensors = list(tensors)
        self.versions = [t._version for t in tensors]
        self.ptrs = [t.data_ptr() for t in tensors]
        self.calls_since_reset = 0
        # Sampled elements, for the Python check: position in weights, reader (a
        # memoryview or NumPy view over the weight's memory), index into it, value when
        # frozen. (The C++ check samples the same elements without NumPy, whose views
        # would leave the weights' storages unresizable.)
        self._sampled, self._views, self._where, self._values = [], [], [], []
        with unset_fake_temporarily():  # built while compiling, under FakeTensorMode
            self._native = _native_check(self.tensors, self.sample)
            if self._native is None and self.sample:
                self._take_samples(tensors)
        if self.sample:
            offload.page_out()  # finding each sample read every weight, offloaded ones too
        #: ``same_registered``'s C++ check, to call without a Python frame, or None (the
        #: registries are not set, or are checked in Python).
        self.registered_check: Callable[[], bool] | None = None
        if self._registries is not None:
            self._register()

    def _take_samples(self, tensors: list[torch.Tensor]) -> None:
        for k, t in enumerate(tensors):
            at = _sample_at(t)
            if at is not None:
                self._sampled.append(k)
                reader, where, value = _reader(*at)
                self._views.append(reader)
                self._where.append(where)
                self._values.append(value)

    def same_picked(self, picked) -> bool:
        """Whether no frozen weight changed (``picked``: the frozen inputs, in order). The
        common case, decided in C++ or by C-level maps."""
        if self._native is not None:
            return self._native.same(picked)
        return (
            all(map(operator.is_, picked, self.tensors))
            and list(map(_VERSION, picked)) == self.versions
            and list(map(_DATA_PTR, picked)) == self.ptrs
            and list(map(operator.getitem, self._views, self._where)) == self._values
        )

    def register(self, dicts: list[dict], keys: list) -> Callable[[], bool]:
        """Where each frozen weight is read on a call (``dicts[i][keys[i]]``, its module's
        ``_parameters`` or ``_buffers``), for a caller that has no arguments to pass:
        returns ``same_registered``."""
        self._registries = (list(dicts), list(keys))
        self._register()
        return self.same_registered

    def _register(self) -> None:
        dicts, keys = self._registries
        self.registered_check = None
        if self._native is not None:
            try:
                self._native.set_registries(dicts, keys)
                self.registered_check = self._native.same_registered
            except ValueError:  # a registry that is no plain dict: read in Python
                pass

    def same_registered(self) -> bool:
        """Whether each registry still holds its frozen weight, unchanged (False where
        one lost it: the caller's full path says so)."""
        if self.registered_check is not None:
            return self.registered_check()
        try:
            return self.same_picked(tuple(map(operator.getitem, *self._registries)))
        except KeyError:
            return False

    def changed(self, args) -> str | None:
        """The name of the first frozen weight that changed (``args``: the group's
        inputs), or None."""
        picked = self._pick(args)
        if self._native is not None:
            k = self._native.first_change(picked)
            return None if k < 0 else self.names[k]
        if self.same_picked(picked):
            return None
        for k, a in enumerate(picked):
            if a is not self.tensors[k] or a._version != self.versions[k] or a.data_ptr() != self.ptrs[k]:
                return self.names[k]
        for k, view, index, value in zip(self._sampled, self._views, self._where, self._values):
            if view[index] != value:
                return self.names[k]
        return None


def _native_check(tensors: list[torch.Tensor], sample: bool):
    """The C++ check over ``tensors`` (``same(picked)``, ``first_change(picked)``), or
    None: not built, a big-endian machine (whose sample bits this side does not
    compute), or a tensor it refuses (without storage, such as a wrapper subclass, or
    without version counter, such as an inference tensor)."""
    module = native.load() if sys.byteorder == "little" else None
    if module is None or any(isinstance(t, torch._subclasses.FakeTensor) for t in tensors):
        return None
    raw = [(0, 0, 0)] * len(tensors)
    if sample:
        for k, t in enumerate(tensors):
            at = _sample_at(t)
            if at is not None:
                raw[k] = _raw(t, *at)
    try:
        return module.WeightCheck(tensors, [r[0] for r in raw], [r[1] for r in raw], [r[2] for r in raw])
    except (ValueError, TypeError, RuntimeError):
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


def _sample_at(t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(``t``'s elements, as integers of the same size for floating dtypes, the flat
    index of its largest finite element in magnitude: the first where none is finite, or
    of a bool tensor), or None for a tensor that cannot be read cheaply (not in CPU
    memory, empty, not strided, complex)."""
    if t.device.type != "cpu" or t.numel() == 0 or t.layout != torch.strided or t.is_complex():
        return None
    d = t.detach()
    flat = 0
    if d.is_floating_point():
        flat = _first_largest(d, lambda part: torch.where(torch.isfinite(part), part.abs(), -1).double())
        d = d.view(_BITS[d.dtype])
    elif d.dtype != torch.bool:
        flat = _first_largest(d, (lambda part: part.abs()) if d.is_signed() else (lambda part: part))
    return d, flat


#: Elements read at a time to find the sampled one: temporaries stay a few MB, where
#: whole-tensor ones were three times the largest weight at freezing time.
_CHUNK = 1 << 20


def _first_largest(d: torch.Tensor, key) -> int:
    """The flat (row-major) index of the first element of ``d`` with the largest ``key``,
    read a chunk at a time."""
    flat = d.reshape(-1)  # a view, but for a weight that is not contiguous
    best, at = None, 0
    for start in range(0, flat.numel(), _CHUNK):
        values = key(flat[start:start + _CHUNK])
        i = int(values.argmax())
        value = values[i].item()
        if best is None or value > best:
            best, at = value, start + i
    return at


def _reader(d: torch.Tensor, flat: int) -> tuple:
    """(reader, index, value) of ``_sample_at``'s element for the Python check: a flat
    memoryview (indexing it is about twice as fast as indexing NumPy), or the NumPy view
    with a tuple index where the tensor is not contiguous."""
    view = numpy_view(d)
    if view.flags.c_contiguous:
        reader = memoryview(view.reshape(-1))
        return reader, flat, reader[flat]
    index = np.unravel_index(flat, view.shape)
    return view, index, view[index].copy()


def _raw(t: torch.Tensor, d: torch.Tensor, flat: int) -> tuple[int, int, int]:
    """``_sample_at``'s element for the C++ check: (bytes from the storage's start, its
    size, its bytes as an unsigned little-endian integer), read without NumPy."""
    index = tuple(int(i) for i in np.unravel_index(flat, tuple(t.shape)))
    size = t.element_size()
    offset = (t.storage_offset() + sum(i * s for i, s in zip(index, t.stride()))) * size
    return offset, size, int(d[index].item()) & ((1 << 8 * size) - 1)
