"""Timing shared by the benchmarks: interleaved samples, and the grad mode an
inference scenario is measured under."""

from __future__ import annotations

import contextlib
import statistics
import time

import torch


def _no_sync():
    pass


#: Inference steps enter torch.no_grad() on each call (``--no-grad-per-call``); by default
#: run() measures an inference scenario under one no_grad, as a serving loop that enters
#: it once: its cost per call (benchmarks/results/speed.md) is the caller's, the same for every
#: torch backend, and the whole-model ORT step has none.
PER_CALL_NO_GRAD = False


def grad_mode(scenarios: dict, scenario: str):
    """The grad mode a scenario is measured under (first calls included)."""
    per_sample = scenarios[scenario][0] == "inference" and not PER_CALL_NO_GRAD
    return torch.no_grad() if per_sample else contextlib.nullcontext()



def timed_interleaved(fns: dict, min_time=1.0, repeats=11, settle_s=0.0, sync=_no_sync) -> dict:
    """Median seconds per call of each function, sampled round-robin (A B C A B C ...)
    so that drift in the machine's speed affects every backend alike. Each sample is the
    mean over enough calls to last about min_time / repeats. ``settle_s``: a pause after
    each sample, untimed, so that threads still spinning after one function (ORT with
    allow_spinning) do not slow the next. ``sync`` is called before and after each
    timed region (torch.cuda.synchronize on CUDA: the calls only queue work there)."""
    inner = {}
    for name, fn in fns.items():
        for _ in range(3):
            fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        one = max(time.perf_counter() - t0, 1e-6)
        inner[name] = max(1, int(min_time / repeats / one))
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            n = inner[name]
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            samples[name].append((time.perf_counter() - t0) / n)
            if settle_s:
                time.sleep(settle_s)
    return {name: statistics.median(v) for name, v in samples.items()}


def first_call_seconds(step, sync=_no_sync) -> float:
    """Seconds of ``step``'s first call (capture, compile and run), ``sync`` around it."""
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    return time.perf_counter() - t0


def median_seconds(fn, calls: int = 15, warmup: int = 5) -> float:
    """Median seconds of ``calls`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
