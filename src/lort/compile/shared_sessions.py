"""ORT sessions shared between compiles with equal options (DORT kept one backend per
options, so that two ``torch.compile`` calls with equal options shared its sessions).

lort shares what such a backend would have held, without one backend living for the
process: a group loaded from the disk cache (its key covers the graph, the argument spec,
the library versions and the options that change a translation or a choice) takes the
session an earlier compile built for the same key, threads, device and session settings.
The store holds its sessions weakly: a session lives as long as a compiled group that
runs it, and goes when the last model using it is dropped (compile/lifetime.py), as an
unshared one does.

Sessions holding frozen weights are not shared: a write that bumps no version counter
(``p.data.copy_``) between two compiles would leave the later compile a session of the
old values, and its weight check, which samples the weights as they are when it is
built, would not see it.
"""

from __future__ import annotations

import threading
import weakref

import torch

from ..options import Options

_sessions: "weakref.WeakValueDictionary[tuple, object]" = weakref.WeakValueDictionary()
_lock = threading.Lock()


def key(cache_key: str, options: Options, device: torch.device, threads: int, tf32: bool, frozen) -> tuple | None:
    """What makes two groups' sessions interchangeable: the disk cache's key (the graph,
    its spec, versions, the options of translation and choice) and the session's own
    settings; None for a session with frozen weights (never shared)."""
    if frozen:
        return None
    settings = (options.allow_spinning, options.force_spinning_stop, options.release_openmp,
                options.share_cpu_arena, options.share_cuda_arena, options.cuda_pinned_memory,
                options.graph_optimization_level, repr(options.providers))
    return (cache_key, str(device), threads, tf32, settings)


def get(k: tuple | None):
    """The live session stored under ``k``, or None."""
    if k is None:
        return None
    with _lock:
        return _sessions.get(k)


def put(k: tuple | None, session) -> None:
    if k is None:
        return
    with _lock:
        _sessions[k] = session


def count() -> int:
    """Sessions stored and alive."""
    with _lock:
        return len(_sessions)
