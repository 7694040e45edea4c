"""Inductor, the third engine of executor="auto": a captured graph runs through lort (its
ORT groups, the rest in PyTorch's kernels), in eager PyTorch, or compiled by inductor,
whichever is measured fastest on the real inputs.

Inductor's compile takes seconds to minutes, so the first call does not wait for it: the
graph starts on the placement ready at once (lort's graph or eager PyTorch, chosen on the
first call, on the second for a CPU training graph whose first call runs eager PyTorch, or
over the next calls for a long inference call: graph_executor.py); the first call after
that choice first has inductor
trace the same graph (a Dynamo graph, or ORTModule's exported one; AOTAutograd, forward
and backward, on this thread: FX tracing patches ``torch.nn.Module.__call__``
process-wide, so no other thread may run the model meanwhile) and send its code
generation and C++ compile to inductor's compile subprocess (compile/inductor_compat.py);
calls go on meanwhile, and the first call after it is ready times inductor against the
running placement, forward and backward where the graph trains, and keeps the faster
(``EngineSwitch``). Results do not depend on the swap beyond the engines' own rounding. The choice and its times go to the disk cache
with the graph's other choice: a later process starts on eager PyTorch while inductor
compiles again and swaps without timing.

Scope of this first step: the whole captured graph is the piece (engines do not mix
inside one graph yet), static shapes only (a graph with symbolic sizes keeps lort and
eager), and a graph left in eager under lort's cheapest call is not compiled by inductor.
Where inductor cannot compile (no C++ compiler, an op it refuses), one warning says so
and the choice is among the others; ``Options.engines`` leaves it out without trying.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from typing import Callable

import torch
import torch.fx

from ..diagnostics.records import CLOSE_CALL, GraphRecord
from ..errors import one_line
from ..reasons import Placement
from . import inductor_compat
from .graph_executor import ChooseOnFirstCall
from .tuner import Tuner

logger = logging.getLogger("lort")

_RUNS = {"ort": "through lort", "pytorch": "in eager PyTorch"}
_state = {"broken": None}  # why inductor cannot compile in this process (said once), or None
_state_lock = threading.Lock()


def inductor_broken() -> str | None:
    """Why inductor cannot compile here (an earlier compile failed), or None."""
    return _state["broken"]


def _mark_broken(error: BaseException) -> None:
    with _state_lock:
        if _state["broken"] is not None:
            return
        _state["broken"] = one_line(error)
    msg = (f"lort: inductor could not compile a graph ({_state['broken'][:300]}); executor='auto' chooses between "
           "lort's ORT groups and eager PyTorch only in this process. Options(engines=('ort', 'pytorch')) leaves "
           "inductor out without trying")
    warnings.warn(msg, stacklevel=2)
    logger.warning("%s", msg)


def wants_inductor(options, example_inputs: list) -> str | None:
    """Why this graph gets no inductor candidate, or None where it does."""
    if "inductor" not in options.engines:
        return "inductor left out (Options.engines)"
    if _state["broken"] is not None:
        return f"inductor cannot compile here ({_state['broken']})"
    if any(isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)) for a in example_inputs):
        return "the graph has symbolic sizes (inductor's engine takes static shapes for now)"
    return None


def _decided(current: Callable) -> bool:
    """Whether the placement running before inductor is chosen (a ChooseOnFirstCall may
    still be timing lort's graph against eager PyTorch over calls)."""
    return not isinstance(current, ChooseOnFirstCall) or current.chosen is not None


class EngineSwitch:
    """A captured graph's callable under executor="auto" with inductor among the engines:
    calls go to ``current`` (lort's graph, a ChooseOnFirstCall, or eager PyTorch) until
    inductor's compile is ready, then, once, inductor is timed against the placement that
    ran (unless ``decided``: a choice read from the disk cache), and every later call goes
    to the faster. ``records``: the graph's records (lort's forward and backward, or its
    record as an eager graph), marked with the engine chosen."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list, current: Callable, eager: Callable,
                 records: list[GraphRecord], tuner: Tuner, cache, key, name: str, decided: str | None = None,
                 times: dict | None = None):
        self._current, self._eager, self._records = current, eager, records
        self._tuner, self._cache, self._key, self._name = tuner, cache, key, name
        self._decided, self._times = decided, dict(times or {})
        self._fn: Callable | None = None  # the engine chosen for good
        self._start = time.perf_counter()
        self._job: inductor_compat.BackgroundCompile | None = None
        self._gm, self._inputs = gm, list(example_inputs)
        self._calls = 0
        #: seconds from the graph's capture to the engine's final choice; seconds of
        #: inductor's trace on the caller's thread, and of its whole compile
        self.settled_s: float | None = None
        self.trace_s: float | None = None
        self.compile_s: float | None = None
        self.engine: str | None = None

    @property
    def chosen(self) -> Callable | None:
        """The callable every call goes to once the engine is chosen (lort's graph or its
        first-call choice, eager PyTorch, or inductor's code), else None."""
        return self._fn

    @property
    def waiting(self) -> str | None:
        """What the choice waits for (None once the engine is chosen): inductor's compile
        not started yet, or running for how long."""
        if self.engine is not None:
            return None
        if self._job is None:
            return f"inductor's compile not started ({self._calls} calls)"
        return f"inductor's compile running for {time.perf_counter() - self._start:.0f} s"

    def _launch(self) -> bool:
        """Start inductor's compile; False (and the running placement kept) where it
        cannot."""
        gm, inputs, self._gm, self._inputs = self._gm, self._inputs, None, None
        start = time.perf_counter()
        try:
            self._job = inductor_compat.start(gm, inputs)
        except Exception as e:  # noqa: BLE001 - inductor left out, the graph runs as it did
            _mark_broken(e)
            self._note(f"inductor could not trace it ({one_line(e)})")
            return False
        finally:
            self.trace_s = time.perf_counter() - start
        logger.info("lort: %s: inductor's compile started (traced in %.2f s; its code is generated in the "
                    "background)", self._name, self.trace_s)
        return True

    def __call__(self, *args):
        fn = self._fn
        if fn is not None:
            return fn(*args)
        job = self._job
        if job is None:
            # The second call starts inductor; where lort's graph and eager PyTorch are not
            # chosen yet (timed over calls, or on a CPU training graph's second call:
            # graph_executor.py), the first call after that choice:
            # inductor's compile subprocess would load the cores they are timed on.
            if self._calls >= 1 and _decided(self._current) and not self._launch():
                self._keep(*self._running())
            self._calls += 1
            return self._current(*args)
        if job.ready():
            fn = self._settle(job, list(args))
            return fn(*args)
        return self._current(*args)

    def _running(self) -> tuple[str, Callable]:
        """The placement the calls go to before inductor: its name and callable."""
        current = self._current
        chosen = getattr(current, "chosen", None)
        if chosen is not None:
            current = chosen
        if current == self._eager:  # a bound method: equal, not the same object
            return Placement.PYTORCH.value, current
        return Placement.ORT.value, current

    def _settle(self, job: inductor_compat.BackgroundCompile, args: list) -> Callable:
        self._job = None
        self.compile_s = time.perf_counter() - self._start
        running, current = self._running()
        try:
            inductor = job.result()
        except Exception as e:  # noqa: BLE001 - the subprocess's compile failed
            _mark_broken(e)
            self._note(f"inductor could not compile it ({one_line(e)})")
            return self._keep(running, current)
        if self._decided == "inductor":
            return self._take_inductor(inductor, self._times, cached=True, compile_s=self.compile_s)
        candidates = {running: current, Placement.INDUCTOR.value: inductor}
        times = self._tuner.time_graph(candidates, args)
        if not times:  # inductor's code, or the running placement, raised on the timing's inputs
            logger.warning("lort: %s: inductor compiled the graph but its timing failed (%s); it runs %s",
                           self._name, self._tuner.timing_failure, _RUNS[running])
            self._note(f"inductor compiled it but its timing failed ({self._tuner.timing_failure}); "
                       f"it runs {_RUNS[running]}")
            return self._keep(running, current)
        if abs(times["inductor"] / times[running] - 1.0) < CLOSE_CALL:  # a close call: more samples
            more = self._tuner.time_graph(candidates, args) or {}
            times = {k: min(v, more.get(k) or v) for k, v in times.items()}
        merged = {**(self._records[0].executor_times if self._records else {}), **self._times, **times}
        logger.info("lort: %s: inductor ready %.1f s after the capture; %.3f ms with inductor, %.3f ms %s",
                    self._name, self.compile_s, times["inductor"] * 1e3, times[running] * 1e3,
                    _RUNS[running])
        if times["inductor"] < self._tuner.graph_eager_margin * times[running]:
            self._store("inductor", merged)
            return self._take_inductor(inductor, merged, cached=False, compile_s=self.compile_s)
        self._store(running, merged)
        for record in self._records:
            record.executor_times = {**record.executor_times, **merged}
        return self._keep(running, current)

    def _note(self, text: str) -> None:
        for record in self._records:
            record.engine_notes.append(text)

    def _keep(self, running: str, current: Callable) -> Callable:
        self._fn = current
        self._finish(running)
        return current

    def _take_inductor(self, inductor: Callable, times: dict, cached: bool, compile_s: float | None) -> Callable:
        for record in self._records:
            record.ran_whole_in_inductor(times, cached=cached, compile_s=compile_s)
        self._current = None  # lort's graph: its ORT sessions were released by the records
        self._fn = inductor
        self._finish("inductor")
        return inductor

    def _finish(self, engine: str) -> None:
        self.engine = engine
        self.settled_s = time.perf_counter() - self._start
        self._eager = None

    def drop(self) -> None:
        """The module whose weights the graph was captured with is gone: the example
        inputs held for inductor's trace (that module's tensors) go. The graph itself may
        still run (Dynamo gives it to another instance of the module's class): where
        inductor's compile had not started, the running placement is kept for good."""
        if self._fn is None and self._job is None and self._gm is not None:
            self._fn = self._current
            self._finish(self._running()[0])
        self._gm = self._inputs = None

    def _store(self, engine: str, times: dict) -> None:
        if self._cache is not None:
            self._cache.store_record(self._key, {"executor": engine, "times": times})
