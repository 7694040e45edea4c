"""PyTorch's OpenMP workers, released before a long ORT run on CPU (Options.release_openmp).

PyTorch's CPU kernels run on an OpenMP team (GNU libgomp in PyTorch's Linux wheels). When a
parallel region ends, its workers wait for the next one by spinning before they sleep
(libgomp: ``GOMP_SPINCOUNT``, 300,000 iterations by default, several milliseconds), so for
milliseconds after a PyTorch op its workers hold the cores an ORT run started then needs.
On a 2-core AMD EPYC, a [512x3072] x [3072x768] MatMul in ORT took 21.4 ms there against
13.9 ms with ``GOMP_SPINCOUNT=0`` (benchmarks/studies/openmp_spin.md). Those variables are
read when the runtime loads, with torch, before lort can set them; OpenMP 5.0's
``omp_pause_resource_all`` releases the workers at run time: libgomp ends the calling
thread's team (its next parallel region starts new threads, 0.1 ms and more). Intel's and
LLVM's runtimes export the same call; lort has measured it with libgomp only.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Callable

logger = logging.getLogger("lort")

#: A run is preceded by a release only where its session's last run took at least this
#: long: releasing costs about 0.1 ms, and PyTorch's next parallel region pays for new
#: threads (up to a few ms on the first op after it, measured in openmp_spin.md).
MIN_RUN_S = 0.010
_OMP_PAUSE_SOFT = 1
#: The file names of the OpenMP runtimes looked for among the process's loaded libraries.
_RUNTIMES = ("libgomp", "libiomp5", "libomp")
_found: list = []  # [release function or None], once looked up
_lock = threading.Lock()


def _loaded_runtimes(maps: str = "/proc/self/maps") -> list[str]:
    """Paths of the OpenMP runtimes loaded in this process (Linux; [] elsewhere)."""
    try:
        with open(maps, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    paths = {line.split(None, 5)[-1] for line in lines if line.count(" ") >= 5 and "/" in line}
    return sorted(p for p in paths if os.path.basename(p).startswith(_RUNTIMES) and ".so" in p)


def _lookup() -> Callable[[], int] | None:
    import torch  # noqa: F401 - loads the OpenMP runtime PyTorch's kernels use

    pauses = []
    for path in _loaded_runtimes():
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all  # the library already loaded: same handle
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        pauses.append(fn)
        logger.info("lort: ORT runs of %.0f ms or more release the OpenMP workers of %s first (Options.release_openmp)",
                    MIN_RUN_S * 1e3, path)
    if not pauses:
        logger.info("lort: no OpenMP runtime with omp_pause_resource_all is loaded; ORT runs release no workers")
        return None

    def release_all() -> int:
        results = [fn(_OMP_PAUSE_SOFT) for fn in pauses]
        return next((r for r in results if r), 0)

    return release_all


def release_function() -> Callable[[], int] | None:
    """A function that releases the calling thread's OpenMP workers (every loaded runtime
    with ``omp_pause_resource_all``) and returns 0 where the runtimes took the pause, or
    None where none is loaded. Inside a parallel region the runtime refuses the pause
    (nonzero) and nothing happens."""
    if not _found:
        with _lock:
            if not _found:
                _found.append(_lookup())
    return _found[0]
