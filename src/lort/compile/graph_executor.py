"""executor="auto" for a whole graph: lort's compiled graph against eager PyTorch,
timed by the tuner on the first call (Dynamo's compile context is no place to run the
graph and compile its backward), then fixed. Every call then goes to the faster, and
the graph's records say which.

An inference graph whose call is long (lort's first run past the tuner's
``graph_budget_s``: a batch of BERT-base, seconds a call) is not timed on extra calls:
its first call returns lort's run (its warm-up), the next one eager PyTorch's (its
warm-up), and the calls after that alternate between them, each timed, until each has
``LONG_SAMPLES`` samples (twice as many where the two are a close call); the faster is
then fixed. The user's own calls are the samples, so the first call pays for no
candidate but lort's graph; the calls meanwhile return either engine's result (each
within the engines' own rounding of eager's). A call of other sizes (a graph with
symbolic sizes) ends the sampling and is timed on its own inputs.

A graph that trains on CPU (its backward runs after the call, outside it) runs its first
call in eager PyTorch, untimed: that placement is ready at once, where lort's graph would
first compile its backward and the timing run both engines' steps (a 0.2B decoder's
first training step: 10.8 s of backward compile and 13 s of timing runs). Its second
call times lort's graph against eager PyTorch, forward and backward on copies of its
inputs, as the first call did before, and runs the faster. CUDA graphs are timed on the
first call."""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ..diagnostics.records import GraphRecord, close_call
from ..reasons import Placement
from ..runtime.memory import give_back_memory
from .tuner import Tuner, trains

#: Samples of each engine a long inference call is chosen by (doubled for a close call).
LONG_SAMPLES = 2
#: A training graph's records between its first call (eager PyTorch's) and its choice.
NOT_CHOSEN_YET = ("not chosen yet: its first training call ran in eager PyTorch; lort's graph and eager "
                  "PyTorch are timed on its next call")

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
        #: Per engine, the seconds of the calls sampled so far (a long inference call), or
        #: None; the sampled calls' argument sizes.
        self._samples: dict[str, list[float]] | None = None
        self._shapes: list | None = None
        self._eager_warm = False
        self._eager_first = False  # a CPU training graph's first call ran in eager PyTorch

    @property
    def chosen(self) -> Callable | None:
        """The callable every call goes to, once chosen (on the first call, or after the
        sampled calls of a long inference graph)."""
        return self._fn

    def __call__(self, *args):
        fn = self._fn
        if fn is not None:
            return fn(*args)
        if self._samples is not None:
            return self._sample(args)
        if self._samples_calls(args):
            start = time.perf_counter()
            out = self._compiled(*args)
            if time.perf_counter() - start > self._tuner.graph_budget_s:
                self._samples = {Placement.PYTORCH.value: [], Placement.ORT.value: []}
                self._shapes = _shapes(args)
                logger.info("lort: %s: a call takes %.2f s: lort's graph and eager PyTorch are timed on the next "
                            "calls", self._name(), time.perf_counter() - start)
                return out
            fn = self._fn = self._choose(list(args))
            return out  # lort's run: this call's result, whichever engine is chosen
        if not self._eager_first and _on_cpu(args):  # a training call: its backward follows
            self._eager_first = True
            for record in self._records:
                record.engine_notes.append(NOT_CHOSEN_YET)
            logger.info("lort: %s: its first training call runs in eager PyTorch; lort's graph is timed against "
                        "it on the next call", self._name())
            return self._eager(*args)
        fn = self._fn = self._choose(list(args))
        return fn(*args)

    @staticmethod
    def _samples_calls(args: tuple) -> bool:
        """Whether a call may serve as a timing sample: an inference call (no backward
        to follow it) on CPU tensors."""
        return not trains(list(args)) and _on_cpu(args)

    def _sample(self, args: tuple):
        """One call of a long inference graph, on the engine with fewer samples, timed."""
        samples = self._samples
        if _shapes(args) != self._shapes:  # a graph with symbolic sizes: samples of one size only
            self._samples = None
            fn = self._fn = self._choose(list(args))
            return fn(*args)
        name = min(samples, key=lambda k: len(samples[k]))  # eager PyTorch first
        fn = self._compiled if name == Placement.ORT.value else self._eager
        start = time.perf_counter()
        out = fn(*args)
        if self._eager_warm:
            samples[name].append(time.perf_counter() - start)
        else:  # eager's first call is its warm-up, as lort's first run was
            self._eager_warm = True
            return out
        n = min(len(v) for v in samples.values())
        if n >= LONG_SAMPLES:
            times = {k: min(v) for k, v in samples.items()}
            if n >= 2 * LONG_SAMPLES or not close_call(times):
                seconds = sum(sum(v) for v in samples.values())
                self._samples = None
                self._fn = self._decide(times, seconds, over_calls=2 * n)
        return out

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
        return self._decide(times, seconds)

    def _name(self) -> str:
        return "+".join(r.name for r in self._records) or "graph"

    def _decide(self, times: dict | None, seconds: float, over_calls: int = 0) -> Callable:
        compiled, eager = self._compiled, self._eager
        for record in self._records:
            if NOT_CHOSEN_YET in record.engine_notes:
                record.engine_notes.remove(NOT_CHOSEN_YET)
        executor = self._tuner.choose_graph_executor(times)
        if self._cache is not None and times:
            self._cache.store_record(self._key, {"executor": executor.value, "times": times})
        if times and (executor == Placement.PYTORCH or self._progress or over_calls):
            logger.info(
                "lort: %s: whole graph timed in %.2f s%s: %.3f ms through lort, %.3f ms in eager PyTorch; runs %s",
                self._name(), seconds, f" (over {over_calls} of its calls)" if over_calls else "",
                times["ort"] * 1e3, times["pytorch"] * 1e3,
                "through lort" if executor == Placement.ORT else "in eager PyTorch",
            )
        if executor == Placement.ORT:
            for record in self._records:
                record.executor_times = dict(times or {})
            return compiled
        for record in self._records:
            record.ran_whole_in_pytorch(times)
        self._compiled = None  # its ORT sessions go
        return eager


def _on_cpu(args) -> bool:
    return all(a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor))


def _shapes(args) -> list:
    """A call's argument sizes (a graph with symbolic sizes takes them as ints too)."""
    return [tuple(a.shape) if isinstance(a, torch.Tensor) else a if isinstance(a, int) else None for a in args]
