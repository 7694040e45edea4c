"""executor="auto" for a whole graph: lort's compiled graph against eager PyTorch,
timed by the tuner on the first call (Dynamo's compile context is no place to run the
graph and compile its backward), then fixed. Every call then goes to the faster, and
the graph's records say which."""

from __future__ import annotations

import logging
import time
from typing import Callable

from ..diagnostics.records import GraphRecord
from ..reasons import Placement
from ..runtime.memory import give_back_memory
from .tuner import Tuner

logger = logging.getLogger("lort")


class ChooseOnFirstCall:
    """Wraps a captured graph's compiled callable. ``eager`` runs the same graph in
    PyTorch (the Dynamo graph's ``forward``, or the module itself); ``records`` is the
    list this graph's compiles append to (its backward, compiled by the timing, included)."""

    def __init__(self, eager: Callable, compiled, records: list[GraphRecord], tuner: Tuner, cache, key,
                 progress: bool):
        self._eager, self._compiled, self._records = eager, compiled, records
        self._tuner, self._cache, self._key, self._progress = tuner, cache, key, progress
        self._fn: Callable | None = None

    @property
    def chosen(self) -> Callable | None:
        """The callable every call goes to, once the first call chose it."""
        return self._fn

    def __call__(self, *args):
        fn = self._fn
        if fn is None:
            fn = self._fn = self._choose(list(args))
        return fn(*args)

    def _choose(self, args: list) -> Callable:
        compiled, eager = self._compiled, self._eager
        start = time.perf_counter()
        candidates = {Placement.ORT.value: compiled, Placement.PYTORCH.value: eager}
        times = self._tuner.time_graph(candidates, args)
        times = self._tuner.timed_again_if_close(times, lambda: self._tuner.time_graph(candidates, args))
        seconds = time.perf_counter() - start
        if not times:  # a candidate raised: lort's graph runs (choose_graph_executor)
            for record in self._records:
                record.engine_notes.append(f"the whole graph's timing against eager PyTorch failed "
                                           f"({self._tuner.timing_failure}); lort's graph runs")
        # The timing runs' activations and gradients, freed, back to the system before the
        # call itself allocates its own (glibc kept 0.5 GB of BERT-base's, adding to the peak).
        give_back_memory()
        executor = self._tuner.choose_graph_executor(times)
        if self._cache is not None and times:
            self._cache.store_record(self._key, {"executor": executor.value, "times": times})
        if times and (executor == Placement.PYTORCH or self._progress):
            logger.info(
                "lort: %s: whole graph timed in %.2f s: %.3f ms through lort, %.3f ms in eager PyTorch; runs %s",
                "+".join(r.name for r in self._records) or "graph", seconds, times["ort"] * 1e3,
                times["pytorch"] * 1e3, "through lort" if executor == Placement.ORT else "in eager PyTorch",
            )
        if executor == Placement.ORT:
            for record in self._records:
                record.executor_times = dict(times or {})
            return compiled
        for record in self._records:
            record.ran_whole_in_pytorch(times)
        self._compiled = None  # its ORT sessions go
        return eager
