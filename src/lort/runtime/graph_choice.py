"""executor="auto" for a whole graph: lort's compiled graph against eager PyTorch.

AOTAutograd's decomposed graphs can run slower than the eager module even when every
group is placed where it runs fastest: eager calls PyTorch's fused kernels (layer norm
backward, softmax backward, the encoder layer's fast path), the decomposed graph runs
them as chains of small ops. So at compile time both are timed on the graph's own inputs
(forward, and backward when the graph trains); where eager is faster, the graph runs
in eager PyTorch and the report says so.

The timing runs on clones of the inputs and restores the RNG state, so parameters,
buffers (batch norm's running stats) and random streams are as if it never ran.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from . import cuda

logger = logging.getLogger("lort")

#: Eager takes the graph when its time is below MARGIN x lort's. 1.0: lort must be
#: faster than eager to run, since eager is what a user would otherwise have (the group
#: level choice keeps its 10% margin: there PyTorch runs a decomposed graph).
MARGIN = 1.0
#: Timing budget per candidate, in seconds (at least MIN_SAMPLES samples each).
BUDGET_S = 0.3
MIN_SAMPLES = 3
MAX_SAMPLES = 15


def trains(example_inputs: list) -> bool:
    """Whether the graph's call records autograd (AOTAutograd then compiles a backward)."""
    return torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in example_inputs
    )


def _clone(a):
    """A copy the timing runs may mutate. Leaves that require grad (parameters) are
    used as they are: a graph cannot modify them in place (autograd forbids it), and
    gradients are taken with autograd.grad, which leaves their .grad alone; not
    copying them keeps the timing from doubling the model's memory."""
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


def time_candidates(candidates: dict[str, Callable], example_inputs: list) -> dict[str, float] | None:
    """Seconds of a call (with its backward when the graph trains) of each candidate:
    the fastest of samples taken round-robin on clones of ``example_inputs`` (the
    minimum, because other load on the machine slows PyTorch's OpenMP threads far more
    than ORT's and would bias a median); None if one fails (lort's graph is kept)."""
    train = trains(example_inputs)
    device = next((a.device for a in example_inputs if isinstance(a, torch.Tensor) and a.is_cuda), None)
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device is not None else None
    try:
        args = [_clone(a) for a in example_inputs]
        samples: dict[str, list[float]] = {name: [] for name in candidates}
        for fn in candidates.values():  # warm-up: lazy compiles (the backward), caches
            _step(fn, args, train)
            _step(fn, args, train)
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
            if n >= MAX_SAMPLES or (n >= MIN_SAMPLES and spent > BUDGET_S * len(candidates)):
                break
        return {name: min(v) for name, v in samples.items()}
    except Exception as e:  # noqa: BLE001 - a timing failure must not fail compilation
        logger.info("lort: whole-graph timing failed (%s); keeping lort's graph", e)
        return None
    finally:
        torch.set_rng_state(rng)
        if device is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
