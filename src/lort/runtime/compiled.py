"""What the compile stage hands the runtime for one fusion group: a frozen value.

The runtime (``runtime/group.py``) only binds, runs and checks it; everything here was
decided at compile time (lort.compile): the ONNX model and its plain fallback, the ORT
fusions that fired, how tensors cross the group's boundary (permuted layouts, restrides,
output dtypes and shapes), the ORT thread count, where the group runs, and the timings
those choices were made by.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from ..reasons import Placement
from .frozen import FrozenWeight
from .session import GroupSession, OutputSpec


@dataclasses.dataclass(frozen=True)
class Boundary:
    """How tensors cross into and out of the ONNX model."""

    #: Per input: the permutation that gives its physical (dense) order, or None.
    in_perms: tuple
    #: Per output: the permutation from physical back to logical order, or None.
    out_inverse: tuple
    #: Per output: (shape, stride) of a layout to copy the output into, or None.
    restride: tuple
    #: The ONNX model's outputs: dtype and static shape (None: known after a run).
    outputs: tuple[OutputSpec, ...]
    #: Symbolic dims in the graph: one session serves every shape.
    dynamic: bool


@dataclasses.dataclass(frozen=True)
class CompiledGroup:
    """One fusion group, compiled."""

    name: str
    #: The group's FX graph: what runs in PyTorch (executor "pytorch", debug mode, fallback).
    gm: torch.fx.GraphModule
    #: where[i]: which of the module's (deduplicated) outputs is the group's output i.
    where: tuple[int, ...]
    device: torch.device
    boundary: Boundary
    #: The ONNX model ORT runs (None in mode "pytorch"), and the plain translation to fall
    #: back to when the ORT-fused model fails at its first run (None: nothing to fall back to).
    model_bytes: bytes | None = None
    plain_bytes: bytes | None = None
    #: onnxscript ORT fusion rewrites that fired, by name.
    fusions: dict = dataclasses.field(default_factory=dict)
    #: The session runs the ORT-fused model (onnxscript's rewrites and optimizer: constant
    #: folding, batch norm into convolutions, ...), not the plain translation; true even
    #: where no named rewrite fired.
    fused: bool = False
    #: ORT intra-op threads, and the times (seconds) they were chosen by.
    threads: int = 1
    thread_times: dict = dataclasses.field(default_factory=dict)
    #: Where the group runs, and the times (seconds, keys "ort" and "pytorch") it was chosen by.
    executor: Placement = Placement.ORT
    executor_times: dict = dataclasses.field(default_factory=dict)
    #: ORT's error when an earlier run (this process or the disk cache's) failed, or None.
    run_failure: str | None = None
    from_cache: bool = False
    #: Seconds compiling spent per step ('translate', 'session', 'timing').
    prepare_times: dict = dataclasses.field(default_factory=dict)
    #: The session built at compile time for the graph's own spec, and that spec (or None).
    session: GroupSession | None = dataclasses.field(default=None, compare=False)
    session_key: tuple | None = None
    #: Inputs frozen into ``session`` as ORT initializers (an inference graph's weights);
    #: ``model_bytes`` then has them as inputs (what runs if they are unfrozen).
    frozen: tuple[FrozenWeight, ...] = ()
    #: Whether the run-time check also compares a sampled element (freeze="auto").
    freeze_sample: bool = True
    #: Weights of the group that stayed inputs, by why.
    kept_inputs: dict = dataclasses.field(default_factory=dict)
    #: How ORT's optimizer changed the graph of ``session`` (runtime/session.py's
    #: optimizer_changes), recorded with Options.record_ort_graph; else empty.
    ort_optimizer: dict = dataclasses.field(default_factory=dict)


def spec_key(args, dynamic: bool, cuda: bool, tf32: bool = False) -> tuple:
    """The argument spec a group's session is cached by: dtypes, shapes (ranks for a
    dynamic graph, whose ONNX model has symbolic dims) and devices, and the numerics
    setting on CUDA (TF32)."""
    if dynamic:
        spec = tuple((a.dtype, a.dim(), a.device) if isinstance(a, torch.Tensor) else "scalar" for a in args)
    else:
        spec = tuple((a.dtype, tuple(a.shape), a.device) if isinstance(a, torch.Tensor) else "scalar" for a in args)
    return (*spec, ("tf32", tf32)) if cuda else spec
