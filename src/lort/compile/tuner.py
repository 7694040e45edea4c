"""The tuner: every timing lort takes and every choice it makes from one.

Three decisions, each from timings on inputs of the real shapes:

- **threads** (``choose_threads``): a group's ORT session with torch's thread count
  against one thread, sampled round-robin (CPU; small groups run faster on one);
- **group executor** (``choose_group_executor``, executor="auto"): a group in ORT against
  its FX graph in PyTorch; PyTorch takes it when below ``group_pytorch_margin`` x ORT's
  time (there PyTorch runs a decomposed graph, so ORT keeps a margin);
- **graph executor** (``choose_graph_executor``, executor="auto", on the first call):
  lort's compiled graph against eager PyTorch (forward, and backward when the graph
  trains); eager takes it when below ``graph_eager_margin`` x lort's time (0.98: eager
  must win clearly; lort runs no graph more than 2% slower than eager). A CPU inference
  group whose run is long (``surely_long`` from its products' flops, ``left_to_graph``
  from its first run) is left to this choice, made over the graph's calls.

Where ORT and PyTorch time within 5% of each other (a close call), both are timed again
and the faster of each taken, so that the choice flips less often between processes.
  AOTAutograd's decomposed graphs can run slower than the eager module even when every
  group is placed where it runs fastest: eager calls PyTorch's fused kernels.

The tuner is passed to the backend (``LortBackend(options, tuner=...)``); a test
replaces it by a subclass. The whole-graph timing runs on clones of the inputs and
restores the RNG state, so parameters, buffers and random streams are as if it never ran.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

import numpy as np
import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..diagnostics.records import close_call
from ..errors import one_line
from ..options import Options
from ..reasons import Placement, ReasonKind
from ..runtime import cuda
from ..runtime.frozen import timing_runs
from ..runtime.session import GroupSession, create_session
from .layout import inverse

logger = logging.getLogger("lort")


@dataclasses.dataclass
class Tuner:
    """Timers, margins and the three decisions. Subclass to replace a timer in a test."""

    #: A group runs in PyTorch when its PyTorch time is below this x its ORT time.
    group_pytorch_margin: float = 0.9
    #: A whole graph runs in eager PyTorch when eager's time is below this x lort's: eager
    #: must win clearly, so that a near tie does not flip between processes (and a cached
    #: "eager" choice leave a graph out of ORT for good), within the training bar of
    #: 0.98x eager's speed (benchmarks/results/scale.md).
    graph_eager_margin: float = 0.98
    #: A group runs on one ORT thread only when its time there is below this x its time
    #: with all threads: choices are cached on disk, and a sample taken while the machine
    #: was busy must not pin a compute-heavy group to one thread for good.
    thread_margin: float = 0.9
    #: A group whose run takes longer than this with all threads is not timed with one.
    parallel_work_s: float = 0.02
    #: Thread-count timing goes on, past its minimum of samples, until the runs have taken
    #: this long (or ``thread_max_samples`` rounds): a window of a few milliseconds can
    #: fall wholly inside a spell of other load (another process's compile), which slows
    #: the run with every thread far more than the one on one thread.
    thread_budget_s: float = 0.1
    thread_max_samples: int = 200
    #: Whole-graph timing budget per candidate, in seconds, and samples per candidate.
    graph_budget_s: float = 0.3
    graph_min_samples: int = 3
    graph_max_samples: int = 15
    #: A whole-graph timing of long calls (past ``graph_budget_s``: seconds each on a
    #: training step at real sizes) ends after its first round where one candidate's
    #: warm-up and first sample both took at least this x the other's: a second round
    #: could not turn the choice (ViT-S/16 training at batch 8, ORT's graph 1.4-1.7x
    #: eager's on an Intel Xeon: its first step 33.7 -> 29.4 s).
    graph_decided_ratio: float = 1.25
    #: No core runs float32 products faster than this many operations a second: two
    #: fused multiply-adds of 16 lanes a cycle at 4 GHz (AVX-512). A group's product
    #: flops over this and its threads are the least seconds of its run (surely_long).
    peak_flops_per_thread: float = 2.56e11
    #: An inference graph wholly in ORT groups, each timed against PyTorch, is not timed
    #: again as a whole where the groups' ORT time is at least this long (a call's own
    #: cost, well under a millisecond, is then under 1%: the whole graph could only
    #: repeat the groups' measurement, at seconds a call on a large model) and PyTorch's
    #: is at least ``graph_settled_ratio`` times it. (The groups' PyTorch time is that of
    #: lort's decomposed graph: eager's own kernels could beat it by more than the ratio,
    #: and ORT then keeps a graph eager runs slightly faster; at 1.2 the 0.92B decoder,
    #: 1.15-1.18x in its groups and as a whole, was timed again for 8-14 s in some runs.)
    graph_settled_min_s: float = 0.02
    graph_settled_ratio: float = 1.1
    #: executor="auto" times a graph whose inputs (weights included) take at most
    #: ``tiny_inputs_bytes`` in eager PyTorch before compiling it, and runs it there
    #: uncompiled where eager takes less than lort's cheapest call (compile/call_floor.py):
    #: one eager call past 20x ``tiny_graph_s``, or samples all past it, end that timing
    #: (lort's cheapest call: 0.03 ms inference, 0.14 ms training on a 2-core VM).
    tiny_inputs_bytes: int = 1 << 20
    tiny_graph_s: float = 0.001
    #: Why the last whole-graph timing failed (the exception's type and first line), or
    #: None: the callers put it in the graph's records, where explain shows it.
    timing_failure: str | None = dataclasses.field(default=None, compare=False, repr=False)

    # -- decisions -----------------------------------------------------------------
    def choose_threads(
        self, model_bytes, device: torch.device, options: Options, feeds: list | None, threads: int,
        built=None,
    ) -> tuple[int, dict[int, float | None]]:
        """The thread count for a CPU group (``threads`` or 1) and the times it was
        chosen by; ``built``: an ORT session of the model with ``threads`` threads, timed
        for that count instead of a new one. Raises SessionCreationError if ORT refuses
        the model."""
        if feeds is None:
            return threads, {}
        times = self.time_sessions(model_bytes, device, options, (threads, 1), feeds,
                                   settled=lambda best: not self._one_thread_wins(best, threads),
                                   built=None if built is None else {threads: built})
        return (1 if self._one_thread_wins(times, threads) else threads), times

    def _one_thread_wins(self, times: dict[int, float | None], threads: int) -> bool:
        one, every = times.get(1), times.get(threads)
        return one is not None and every is not None and one < self.thread_margin * every

    def choose_group_executor(self, ort_time: float | None, torch_time: float | None) -> Placement:
        if ort_time is None or torch_time is None:
            return Placement.ORT
        return Placement.PYTORCH if torch_time < self.group_pytorch_margin * ort_time else Placement.ORT

    def left_to_graph(self, ort_time: float | None) -> bool:
        """Whether a CPU inference group whose run takes ``ort_time`` seconds in ORT stays
        there untimed against PyTorch: a run past ``graph_budget_s`` makes its graph's
        calls long, and such a graph is timed against eager PyTorch over its calls
        (graph_executor.ChooseOnFirstCall), each returning its result. Timing the group
        too would add runs of seconds each to the first call (BERT-base at batch 32: 14 s
        of its 28) for a choice the graph's own makes; what is lost is a placement with
        such a group alone in PyTorch."""
        return ort_time is not None and ort_time > self.graph_budget_s

    def surely_long(self, flops: int, threads: int) -> float | None:
        """The least seconds of a CPU inference group's run on ``threads`` threads whose
        products take ``flops``, where that is past ``graph_budget_s`` (left_to_graph's
        case, known before any run, which then no compile-time run is spent on), else None."""
        least = flops / (self.peak_flops_per_thread * max(threads, 1))
        return least if least > self.graph_budget_s else None

    def settled_by_groups(self, records: list) -> dict | None:
        """The whole-graph times (``{"ort": s, "pytorch": s}``, the groups' sums) of an
        inference graph whose groups already decide it for ORT (see
        ``graph_settled_min_s``), or None where the whole graph must be timed: a training
        graph (its backward is timed with it), a tensor op left in PyTorch (lort's graph
        then crosses between the two), a group in PyTorch or untimed, or a close call."""
        if not records or any(r.kind != "inference" for r in records):
            return None
        ort = pytorch = 0.0
        for r in records:
            # In an AOTAutograd graph every tensor op is ATen: what else is left in
            # PyTorch is size arithmetic on SymInts.
            if not r.groups or any(getattr(why, "kind", None) != ReasonKind.NOT_ATEN for _, why in r.fallbacks):
                return None
            for g in r.groups:
                times = g.executor_times
                if g.executor != Placement.ORT or "ort" not in times or "pytorch" not in times:
                    return None
                ort += times["ort"]
                pytorch += times["pytorch"]
        if ort < self.graph_settled_min_s or pytorch < self.graph_settled_ratio * ort:
            return None
        return {"ort": ort, "pytorch": pytorch}

    def timed_again_if_close(self, times: dict | None, again: Callable[[], dict | None]) -> dict | None:
        """``times`` ({"ort": s, "pytorch": s}), or where they are a close call
        (diagnostics.records.close_call) the fastest of them and of ``again()``'s: more
        samples where the choice hangs on a few percent, so that it flips less often
        between processes."""
        if not times or not close_call(times):
            return times
        more = again()
        if not more:
            return times
        return {k: v if more.get(k) is None else min(v, more[k]) for k, v in times.items()}

    def choose_graph_executor(self, times: dict | None) -> Placement:
        """``times``: ``time_graph``'s result with keys "ort" (lort's graph) and "pytorch"."""
        if not times:
            return Placement.ORT
        return Placement.PYTORCH if times["pytorch"] < self.graph_eager_margin * times["ort"] else Placement.ORT

    # -- timers ----------------------------------------------------------------------
    def time_session(
        self, model_bytes: bytes, device: torch.device, options: Options, threads: int, feeds: list
    ) -> float | None:
        """Median seconds of a run of a throwaway session with ``threads`` threads on
        NumPy ``feeds`` (CPU only; None where it cannot be measured). Raises
        SessionCreationError."""
        if device.type != "cpu":
            return None
        return median_run_time(_session_run(model_bytes, device, options, threads, feeds))

    def time_sessions(
        self, model_bytes, device: torch.device, options: Options, counts: tuple[int, ...], feeds: list,
        warmup: int = 2, samples: int = 7, settled: Callable[[dict], bool] | None = None,
        built: dict | None = None,
    ) -> dict[int, float | None]:
        """Seconds of a run of a throwaway session per thread count in ``counts``, on
        NumPy ``feeds``: the fastest of samples taken round-robin (drift in the machine's
        speed hits every count alike; timing one count after the other let a slow spell
        pin a group to the wrong count), ``samples`` of them and more until the runs have
        taken ``thread_budget_s``, unless ``settled(best)`` says the times so far decide
        (choose_threads: all threads already faster; load on the machine slows the run on
        every thread more than the one on one, so it hides that more than it fakes it).
        A first count whose run takes longer than
        ``parallel_work_s`` is the only one timed (enough work to use every thread).
        None for a count that cannot be measured (not CPU, or a run raises). Raises
        SessionCreationError."""
        if device.type != "cpu":
            return {counts[0]: None}
        built = built or {}
        runs = {counts[0]: _session_run(model_bytes, device, options, counts[0], feeds, built.get(counts[0]))}
        first = _seconds(runs[counts[0]])
        if first is None or first > self.parallel_work_s:
            return {counts[0]: first}
        for n in counts[1:]:
            runs[n] = _session_run(model_bytes, device, options, n, feeds, built.get(n))
        best: dict[int, float | None] = {n: float("inf") for n in runs}
        spent = 0.0
        for i in range(warmup + max(samples, self.thread_max_samples)):
            if i >= warmup + samples and (spent >= self.thread_budget_s or (settled is not None and settled(best))):
                break
            for n, run in runs.items():
                if best[n] is None:
                    continue
                elapsed = _seconds(run)
                if elapsed is None:
                    best[n] = None
                    continue
                spent += elapsed
                if i >= warmup:
                    best[n] = min(best[n], elapsed)
            if all(b is None for b in best.values()):
                break
        return best

    def time_group_session(self, sess: GroupSession, feeds: list, device: torch.device) -> float | None:
        """Median seconds of a run of a group's session on ``feeds`` moved to ``device``
        (its real run path: IOBinding, and on CUDA lort's stream ordering)."""
        with unset_fake_temporarily():
            args = [_tensor(f, device) for f in feeds]
            return median_run_time(lambda: sess.run(args), device=device)

    def time_pytorch(self, gm: torch.fx.GraphModule, feeds: list, perms: list, device: torch.device) -> float | None:
        """Median seconds of a run of ``gm`` on ``feeds`` (real tensors: compilation runs
        under FakeTensorMode, which this leaves for the measurement) on ``device``; feeds
        are in physical order, ``perms`` gives each input back its layout."""
        with unset_fake_temporarily(), torch.no_grad():
            args = [
                _tensor(f, device) if p is None else _tensor(f, device).permute(inverse(p))
                for f, p in zip(feeds, perms)
            ]
            return median_run_time(lambda: gm(*args), device=device)

    def time_graph(self, candidates: dict[str, Callable], example_inputs: list) -> dict[str, float] | None:
        """Seconds of a call (with its backward when the graph trains) of each candidate:
        the fastest of samples taken round-robin on clones of ``example_inputs`` (the
        minimum, because other load on the machine slows PyTorch's OpenMP threads far
        more than ORT's and would bias a median); None if one fails."""
        return self._timed_graph(candidates, example_inputs, None)

    def time_tiny_eager(self, eager: Callable, example_inputs: list) -> float | None:
        """Seconds of ``eager``'s call as ``time_graph`` takes it, where at most
        ``tiny_graph_s``; None as soon as it is sure to take longer (its warm-up call 20x,
        or its first ``graph_min_samples`` samples, past it), or if it fails."""
        times = self._timed_graph({"pytorch": eager}, example_inputs, self.tiny_graph_s)
        return times["pytorch"] if times and times["pytorch"] <= self.tiny_graph_s else None

    def _timed_graph(self, candidates: dict[str, Callable], example_inputs: list,
                     give_up_s: float | None) -> dict[str, float] | None:
        train = trains(example_inputs)
        device = next((a.device for a in example_inputs if isinstance(a, torch.Tensor) and a.is_cuda), None)
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(device) if device is not None else None
        self.timing_failure = None
        try:
            with timing_runs():
                return self._time_graph(candidates, example_inputs, train, device, give_up_s)
        except Exception as e:  # noqa: BLE001 - a timing failure must not fail compilation
            self.timing_failure = one_line(e)
            logger.info("lort: whole-graph timing of %s failed (%s)", ", ".join(candidates), self.timing_failure)
            return None
        finally:
            torch.set_rng_state(rng)
            if device is not None:
                torch.cuda.set_rng_state(cuda_rng, device)

    def _time_graph(self, candidates, example_inputs, train, device, give_up_s=None) -> dict[str, float]:
        args = [_clone(a) for a in example_inputs]
        samples: dict[str, list[float]] = {name: [] for name in candidates}
        warm: dict[str, float] = {}
        for name, fn in candidates.items():  # warm-up: lazy compiles (the backward), caches
            t0 = time.perf_counter()
            _step(fn, args, train)
            warm[name] = time.perf_counter() - t0
            if give_up_s is not None and warm[name] > 20 * give_up_s:
                return {name: warm[name]}
        spent = 0.0
        while True:
            for name, fn in candidates.items():
                cuda.synchronize(device)
                t0 = time.perf_counter()
                _step(fn, args, train)
                cuda.synchronize(device)
                elapsed = time.perf_counter() - t0
                samples[name].append(elapsed)
                spent += elapsed
            n = len(next(iter(samples.values())))
            if give_up_s is not None and n >= self.graph_min_samples and any(
                    min(v) > give_up_s for v in samples.values()):
                return {name: min(v) for name, v in samples.items()}
            # A call past the budget (a large model's, seconds each): two rounds, the
            # minimum of which is read, tell as much as three.
            long = n >= 2 and min(min(v) for v in samples.values()) > self.graph_budget_s
            if n == 1 and give_up_s is None:
                first = {name: v[0] for name, v in samples.items()}
                winner = self._clear_winner(first) if min(first.values()) > self.graph_budget_s else None
                long = winner is not None and winner == self._clear_winner(warm)
            if n >= self.graph_max_samples or long or (
                    n >= self.graph_min_samples and spent > self.graph_budget_s * len(candidates)):
                return {name: min(v) for name, v in samples.items()}

    def _clear_winner(self, times: dict[str, float]) -> str | None:
        """The candidate faster than every other by ``graph_decided_ratio``, or None."""
        if len(times) < 2:
            return None
        fastest, second = sorted(times, key=times.get)[:2]
        return fastest if times[second] >= self.graph_decided_ratio * times[fastest] else None


def _session_run(model_bytes, device: torch.device, options: Options, threads: int, feeds: list,
                 session=None) -> Callable:
    """A run of ``session`` (a throwaway one of ``model_bytes`` with ``threads`` threads
    where None) on ``feeds``."""
    if session is None:
        session = create_session(model_bytes, device, options, "timing", threads, count=False)
    named = {i.name: f for i, f in zip(session.get_inputs(), feeds)}
    return lambda: session.run(None, named)


def _seconds(run: Callable) -> float | None:
    """Seconds of one ``run()``; None if it raises (an invalid synthetic input)."""
    try:
        t0 = time.perf_counter()
        run()
        return time.perf_counter() - t0
    except Exception:  # noqa: BLE001 - no measurement
        return None


def median_run_time(
    run, warmup: int = 2, samples: int = 6, long_s: float = 0.05, device: torch.device | None = None
) -> float | None:
    """Median seconds of ``run()`` after ``warmup`` calls; a run longer than ``long_s``
    ends the measurement early. None if ``run`` raises (synthetic inputs can be invalid
    for a graph, e.g. an integer divisor of 0). On a CUDA ``device`` the device is
    synchronized around each timed call (timing only; runs never sync the host)."""
    times = []
    for i in range(warmup + samples):
        try:
            cuda.synchronize(device)
            t0 = time.perf_counter()
            run()
            cuda.synchronize(device)
        except Exception:  # noqa: BLE001 - an invalid synthetic input: no measurement
            return None
        elapsed = time.perf_counter() - t0
        if i >= warmup or elapsed > long_s:
            times.append(elapsed)
        if elapsed > long_s:
            break
    times.sort()
    return times[len(times) // 2]


def trains(example_inputs: list) -> bool:
    """Whether the graph's call records autograd (AOTAutograd then compiles a backward)."""
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in example_inputs)


def _clone(a):
    """A copy the timing runs may mutate. Leaves that require grad (parameters) are
    used as they are: a graph cannot modify them in place (autograd forbids it), and
    gradients are taken with autograd.grad, which leaves their .grad alone; not
    copying them keeps the timing from doubling the model's memory. A symbolic size
    (a graph captured with dynamic shapes gets its sizes as SymInts) is its hint, the
    value of this call: running eager code on the SymInt itself would specialize the
    graph on that value (a guard), and Dynamo would capture it again for every size."""
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        if not a.node.has_hint():
            raise ValueError(f"a symbolic size without a value to time with ({a})")
        return a.node.hint
    if not isinstance(a, torch.Tensor) or (a.requires_grad and a.is_leaf):
        return a
    c = a.detach().clone()  # clone keeps a dense tensor's strides
    if a.requires_grad:
        c.requires_grad_(True)
    return c


def _step(fn: Callable, args: list, train: bool) -> None:
    outs = fn(*args)
    if not train:
        return
    outs = outs if isinstance(outs, (tuple, list)) else [outs]
    ts = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad and o.dtype.is_floating_point]
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if ts and leaves:
        torch.autograd.grad(ts, leaves, [torch.ones_like(t) for t in ts], allow_unused=True)


def _tensor(feed: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(feed)
    return t if device.type == "cpu" else t.to(device)
