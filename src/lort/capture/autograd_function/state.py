"""Capture state: whether lort is capturing a model right now (``lort.is_capturing()``).

A thread-local depth counter, raised by :func:`capturing` around AOTAutograd tracing (the
backend) and around the fake-tensor and dummy runs that find an opaque
autograd.Function's output metadata (``meta.py``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

_state = threading.local()


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Marks the enclosed code as lort capture (``is_capturing()`` is True inside)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def _is_capturing() -> bool:
    return getattr(_state, "depth", 0) > 0


@torch._dynamo.disable(reason="lort.is_capturing() is answered outside traced code")
def is_capturing() -> bool:
    """True while lort captures a model: AOTAutograd tracing, and the fake-tensor and dummy
    runs of an opaque autograd.Function's forward that find its output metadata. False
    while compiled code runs.

    Code that must not run during capture (a collective, I/O) can skip itself::

        if not lort.is_capturing():
            torch.distributed.all_reduce(t)

    Dynamo cannot trace this call: inside an autograd.Function under lort, the function is
    then run opaquely (its real forward runs with ``is_capturing() == False``); elsewhere
    the call is a graph break.
    """
    return _is_capturing()
