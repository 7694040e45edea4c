"""Run the OpInfo conformance sweep (``lort.testing.conformance``) in worker processes.

Each worker takes one op at a time and runs it for every dtype. A worker that dies (a
segfault in a kernel) or runs past the per-op time limit is replaced, and the op's
remaining dtypes are recorded as crashes with that reason. Workers use one thread each
and are replaced every ``RECYCLE`` ops, so that what compiled graphs leave behind does
not pile up.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import warnings
from multiprocessing.connection import wait
from typing import Callable, Iterable

#: Ops a worker runs before it is replaced by a fresh process.
RECYCLE = 150


def _worker(conn, quiet: bool) -> None:
    if quiet:  # ORT and onnxscript write to the C-level stdout/stderr
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    os.environ["LORT_DISK_CACHE"] = "0"
    import torch

    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    from lort.testing.models import make_torchvision_importable

    make_torchvision_importable()
    from lort.testing import conformance

    ops = conformance.ops_by_id()
    conn.send(("ready", None))
    while True:
        task = conn.recv()
        if task is None:
            return
        name, dtypes, samples, extreme = task
        for dtype in dtypes:
            result = conformance.run_op(ops[name], dtype, samples, extreme=extreme)
            conn.send(("result", result.to_json()))
        conn.send(("done", name))


class _Worker:
    def __init__(self, ctx, quiet: bool):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, quiet), daemon=True)
        self.proc.start()
        child.close()
        self.task: tuple | None = None
        self.pending: list[str] = []
        self.started = 0.0
        self.ran = 0
        self.ready = False

    def give(self, task) -> None:
        self.task, self.pending, self.started = task, list(task[1]), time.monotonic()
        self.conn.send(task)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def run_sweep(
    op_names: Iterable[str],
    dtypes: Iterable[str],
    workers: int = 2,
    samples: int | None = None,
    op_timeout_s: float = 300.0,
    quiet: bool = True,
    on_result: Callable | None = None,
    extreme: bool = True,
) -> list:
    """Every op of ``op_names`` for every dtype of ``dtypes``, run in ``workers``
    processes (``samples`` ordinary samples, and the extreme-value sample with
    ``extreme``); the ``conformance.Result`` list, in completion order."""
    from lort.testing import conformance

    samples = conformance.SAMPLES if samples is None else samples
    dtypes = list(dtypes)
    queue = [(name, dtypes, samples, extreme) for name in op_names]
    ctx = mp.get_context("spawn")
    results: list = []
    pool = [_Worker(ctx, quiet) for _ in range(max(1, workers))]

    def record(result):
        results.append(result)
        if on_result is not None:
            on_result(result)

    def fail_rest(w: _Worker, why: str) -> None:
        name = w.task[0]
        for dtype in w.pending:
            record(conformance.Result(op=name, dtype=dtype, status="crash", detail=why,
                                      family=conformance.family(conformance_op(name))))

    op_cache: dict = {}

    def conformance_op(name):
        if not op_cache:
            op_cache.update(conformance.ops_by_id())
        return op_cache[name]

    try:
        while queue or any(w.task for w in pool):
            for i, w in enumerate(pool):
                if w.ready and w.task is None and queue:
                    if w.ran >= RECYCLE:
                        w.conn.send(None)
                        w.stop()
                        pool[i] = w = _Worker(ctx, quiet)
                        continue
                    w.give(queue.pop(0))
            live = {w.conn: w for w in pool}
            for conn in wait(list(live), timeout=5.0):
                w = live[conn]
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    code = w.proc.exitcode
                    w.proc.join(5)
                    if w.task:
                        fail_rest(w, f"worker process died (exit code {w.proc.exitcode if code is None else code})")
                    w.stop()
                    pool[pool.index(w)] = _Worker(ctx, quiet)
                    continue
                if kind == "ready":
                    w.ready = True
                elif kind == "result":
                    result = conformance.Result.from_json(payload)
                    if result.dtype in w.pending:
                        w.pending.remove(result.dtype)
                    record(result)
                elif kind == "done":
                    w.task, w.pending = None, []
                    w.ran += 1
            now = time.monotonic()
            for i, w in enumerate(pool):
                if w.task and now - w.started > op_timeout_s:
                    fail_rest(w, f"timed out after {op_timeout_s:.0f} s")
                    w.stop()
                    pool[i] = _Worker(ctx, quiet)
    finally:
        for w in pool:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
            w.stop()
    return results
