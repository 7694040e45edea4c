"""A fusion group at run time: binds and runs a ``CompiledGroup``, with ORT sessions
cached by argument spec, the run modes, and the fallback when ORT fails at run time."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Callable, Sequence

import torch

from ..errors import MismatchError, SessionRunError
from ..options import Options
from ..reasons import Placement, Reason, ReasonKind
from . import cuda
from .compiled import CompiledGroup, spec_key
from .frozen import WeightGuard, in_timing_run, picker
from .session import GroupSession

logger = logging.getLogger("lort")


class OrtGroup(torch.nn.Module):
    """Runs one compiled fusion group in ORT ('ort'), PyTorch ('pytorch') or both
    ('debug'). An ORT session is built per argument spec (dtypes, shapes, device,
    TF32 on CUDA) and reused for every later call with that spec."""

    def __init__(self, compiled: CompiledGroup, options: Options):
        super().__init__()
        # The group keeps the compiled value without its session and without the frozen
        # weights' tensors: the session lives in the caches below only, the tensors in
        # the guard, and both go when replaced (a re-freeze, a new Parameter, a fallback).
        self.compiled = dataclasses.replace(
            compiled, session=None, frozen=tuple(dataclasses.replace(w, tensor=None) for w in compiled.frozen)
        )
        self.name = compiled.name
        self.gm = compiled.gm
        self.options = options
        self.device = compiled.device
        b = compiled.boundary
        self._in_perms = b.in_perms
        self._out_inverse = b.out_inverse
        self._restride = b.restride
        self._any_in_perm = any(p is not None for p in b.in_perms)
        self._any_out_perm = any(p is not None for p in b.out_inverse)
        self._any_restride = any(r is not None for r in b.restride)
        self._identity_where = list(compiled.where) == list(range(len(compiled.where)))
        self._dynamic = b.dynamic
        self._cuda = self.device.type == "cuda"
        #: The kinds of TF32 work the group has, whose PyTorch flags its sessions follow.
        self._tf32_kinds = cuda.tf32_kinds(compiled.gm) if self._cuda else frozenset()
        # What a run-time failure can change: the model (fused -> plain), where it runs.
        self.model_bytes = compiled.model_bytes
        self._plain_bytes = compiled.plain_bytes
        self.fusions = dict(compiled.fusions)
        self.fused = compiled.fused
        self.executor = compiled.executor
        self.run_failure = compiled.run_failure
        self.sessions: dict[tuple, GroupSession] = {}
        # A static graph's session per numerics setting (TF32 on CUDA; always False on
        # CPU), used without computing the argument spec on each call.
        self._static_sessions: dict[bool, GroupSession] = {}
        if compiled.session is not None and compiled.session_key is not None:
            self.sessions[compiled.session_key] = compiled.session
            if not self._dynamic:
                self._static_sessions[bool(self._cuda and compiled.session_key[-1][1])] = compiled.session
        #: Called with this group after a run-time change of its model or executor (the
        #: compile stage points it at the disk cache), or None.
        self.on_change: Callable[[OrtGroup], None] | None = None
        #: Called with the Reason when ORT fails to run the group (the graph's record), or None.
        self.on_run_failure: Callable[[Reason], None] | None = None
        # Frozen weights: a guard checked on every call, the sessions that hold them (by
        # TF32 setting) and the function that builds one for the current weights (the
        # compile stage's; None or a None result: the weights are unfrozen).
        self._guard = WeightGuard(compiled.frozen, compiled.freeze_sample) if compiled.frozen else None
        self._frozen_idx = {w.index for w in compiled.frozen}
        # The inputs a frozen session takes (the others are its initializers).
        self._live = [i for i in range(len(b.in_perms)) if i not in self._frozen_idx]
        self._frozen_sessions: dict[bool, GroupSession] = {}
        if self._guard is not None and compiled.session is not None:
            self._frozen_sessions[bool(self._cuda and cuda.tf32_enabled(self._tf32_kinds))] = compiled.session
            self.sessions.clear()
            self._static_sessions.clear()
        #: (tensors, tf32) -> GroupSession with those weights frozen, or None.
        self.refreeze: Callable[[list, bool], GroupSession | None] | None = None
        #: How many times the weights were frozen again.
        self.refreezes = 0
        self._quick_changes = 0

    # The compile-time choices, for reports.
    threads = property(lambda self: self.compiled.threads)
    thread_times = property(lambda self: self.compiled.thread_times)
    executor_times = property(lambda self: self.compiled.executor_times)
    from_cache = property(lambda self: self.compiled.from_cache)
    prepare_times = property(lambda self: self.compiled.prepare_times)
    where = property(lambda self: self.compiled.where)

    @property
    def frozen_count(self) -> int:
        """How many weights the group's sessions hold as ORT initializers now."""
        return len(self._frozen_idx) if self._guard is not None else 0

    def frozen_inputs(self) -> set[int]:
        """The positions of the inputs the group's sessions hold frozen now."""
        return set(self._frozen_idx) if self._guard is not None else set()

    def _drop_sessions(self) -> None:
        self.sessions.clear()
        self._static_sessions.clear()
        self._frozen_sessions.clear()

    def release(self, for_good: bool = False) -> None:
        """Free what the group holds for the model it was compiled for: its ORT sessions
        and its frozen weights (the guard's tensors, the sessions' shared initializers).
        Called when that model is gone (compile/lifetime.py); a later call, through a
        cache entry another module instance reuses, builds a session again with the
        weights as inputs. ``for_good``: the group never runs in ORT again (its graph
        runs in eager PyTorch): its models go too."""
        self._guard = None
        self._frozen_idx = set()
        self._drop_sessions()
        self.refreeze = None
        if for_good:
            self.executor = Placement.PYTORCH
            self.model_bytes = self._plain_bytes = None
            self.compiled = dataclasses.replace(self.compiled, model_bytes=None, plain_bytes=None)

    # -- frozen weights ----------------------------------------------------------
    def _frozen_session(self, args, tf32: bool) -> GroupSession | None:
        """The session holding the current weights, freezing them again where they
        changed; None once they are unfrozen (they then go to ORT as inputs)."""
        guard = self._guard
        sess = self._frozen_sessions.get(tf32)
        changed = guard.changed(args)
        if sess is not None:
            if changed is None:
                guard.calls_since_reset += 1
                return sess
            if in_timing_run():
                return sess  # clones of the weights, outputs discarded: not frozen again
        guard.calls_since_reset += 1
        tensors = [args[i] for i in guard.indices]
        if changed is not None:
            # A weight that changes on the calls right after being frozen again changes
            # on every call (a buffer the graph itself updates): it stays an input.
            self._quick_changes = self._quick_changes + 1 if guard.calls_since_reset <= 1 else 0
            if self._quick_changes >= 2:
                self._unfreeze(f"{changed} changes on every call")
                return None
            self._frozen_sessions.clear()
        new = self.refreeze(tensors, tf32) if self.refreeze is not None else None
        if new is None:
            self._unfreeze(f"{changed or 'a weight'} could not be frozen again")
            return None
        if changed is not None:
            self.refreezes += 1
            logger.info("lort: %s: %s changed since it was frozen; frozen again", self.name, changed)
        guard.reset(tensors)
        self._frozen_sessions[tf32] = new
        return new

    def _unfreeze(self, why: str) -> None:
        logger.info("lort: %s: weights go to ORT as inputs from now on (%s)", self.name, why)
        if self.options.quantize is not None:
            # quantized weights are frozen ones: the results change with them
            logger.warning("lort: %s runs its float32 weights from now on, not quantize=%r ones: %s", self.name,
                           self.options.quantize, why)
        self._guard = None
        self._frozen_idx = set()
        self._frozen_sessions.clear()

    def _session(self, key: tuple, tf32: bool) -> GroupSession:
        sess = self.sessions.get(key)
        if sess is None:
            assert self.model_bytes is not None
            sess = GroupSession(
                self.model_bytes, self.device, self.compiled.boundary.outputs, self.options, self.name,
                self.compiled.threads, tf32=tf32,
            )
            self.sessions[key] = sess
            logger.debug("lort: built session %d for %s (spec %s)", len(self.sessions), self.name, key)
        return sess

    # -- run ---------------------------------------------------------------------
    def steady_inputs(self) -> tuple[list[int], list[int]] | None:
        """For a caller that runs this group alone, call after call (ORTModule's direct
        inference): ``(frozen, live)``, the positions of the group's inputs its sessions
        hold frozen and of the ones ORT takes, for ``steady_run``; None where the group
        has no such route (not run in ORT alone, layouts to restore, CUDA, weights not
        frozen)."""
        guard, sess = self._guard, self._frozen_sessions.get(False)
        if (self.options.mode != "ort" or self.executor != Placement.ORT or self._cuda or guard is None
                or sess is None or not sess.static_outputs
                or self._any_in_perm or self._any_out_perm or self._any_restride):
            return None
        return list(guard.indices), list(self._live)

    def steady_run(self, dicts: list[dict], keys: list, live_at: list[int],
                   outputs: list[int] | None = None) -> Callable[[Sequence], list | None] | None:
        """``run(args)``: ``forward``'s outputs by the shortest route, for a caller whose
        ``args[live_at[k]]`` is the group's input at ``steady_inputs``' ``live[k]``, the
        frozen weights read by the weight guard from their modules (``dicts[i][keys[i]]``,
        in the order of ``steady_inputs``' ``frozen``; in C++ where it is built) and
        checked, then the session run; ``outputs``: which of the group's outputs it gives
        (None: all). None where that route does not apply to a call (a weight changed or
        was removed, the session was replaced, ORT failed): the caller then calls
        ``forward``, which handles it. None where ``steady_inputs`` is None."""
        if self.steady_inputs() is None:
            return None
        guard, sess = self._guard, self._frozen_sessions.get(False)
        taken = list(range(len(self.compiled.where))) if outputs is None else list(outputs)
        where = [self.compiled.where[j] for j in taken]  # session output of each output given
        select = None if where == list(range(len(sess.output_names))) else picker(where)
        guard.register(dicts, keys)
        frozen, run = self._frozen_sessions, sess.run
        one = live_at[0] if len(live_at) == 1 else None
        pick = None if one is not None else picker(live_at)

        def steady(args):
            same = guard.registered_check  # reset() may replace it
            if (self._guard is not guard or frozen.get(False) is not sess
                    or not (same() if same is not None else guard.same_registered())):
                return None
            try:
                outs = run([args[one]] if pick is None else pick(args))
            except Exception:  # noqa: BLE001 - forward runs it again and handles the failure
                return None
            guard.calls_since_reset += 1
            return outs if select is None else select(outs)

        return steady

    def _run_ort(self, args) -> list[torch.Tensor]:
        if self._any_in_perm:
            args = [a if p is None else a.permute(p) for a, p in zip(args, self._in_perms)]
        # A static graph is only ever called with its own spec (Dynamo guards shapes,
        # dtypes and devices), so its session is used without computing the spec.
        tf32 = self._cuda and cuda.tf32_enabled(self._tf32_kinds)
        if self._guard is not None:
            sess = self._frozen_session(args, tf32)
            if sess is not None:
                return self._restore_layouts(sess.run([args[i] for i in self._live]))
        sess = self._static_sessions.get(tf32)
        if sess is None:
            sess = self._session(spec_key(args, self._dynamic, self._cuda, tf32), tf32)
            if not self._dynamic:
                self._static_sessions[tf32] = sess
        return self._restore_layouts(sess.run(args))

    def _restore_layouts(self, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        if self._any_out_perm:
            outs = [o if q is None else o.permute(q) for o, q in zip(outs, self._out_inverse)]
        if self._any_restride:
            for i, rs in enumerate(self._restride):
                if rs is not None:
                    outs[i] = torch.empty_strided(rs[0], rs[1], dtype=outs[i].dtype, device=outs[i].device).copy_(outs[i])
        return outs

    def _run_ort_or_fall_back(self, args) -> list[torch.Tensor]:
        """ORT's outputs; where ORT fails at run time (a kernel that rejects what a
        fusion rewrite built, say), the weights are unfrozen and the plain translation
        is tried, then the group runs in PyTorch from now on, with one warning naming
        its ops and the error (SessionRunError with fallback="raise")."""
        try:
            outs = self._run_ort(args)
        except Exception as e:  # noqa: BLE001 - any ORT run error: fall back, never a wrong result
            error = e
            while self._step_back(error):
                try:
                    outs = self._run_ort(args)
                    self._changed()
                    return outs
                except Exception as e2:  # noqa: BLE001
                    error = e2
            return self._fall_back_at_run(args, error)
        if self._plain_bytes is not None:  # (nn.Module's __setattr__ is slow: not every call)
            self._plain_bytes = None  # the fused model ran: nothing to fall back to
        return outs

    def _step_back(self, error: Exception) -> bool:
        """After ORT failed to run the group: unfreeze its weights, else switch from the
        ORT-fused model to the plain one; False when nothing is left to try in ORT."""
        if self._guard is not None:
            self._unfreeze(f"ORT failed to run the model with frozen weights: {error}")
            return True
        if self._plain_bytes is not None:
            logger.info("lort: %s: the ORT-fused model failed to run (%s); using the plain one", self.name, error)
            self.model_bytes, self._plain_bytes, self.fusions, self.fused = self._plain_bytes, None, {}, False
            self._drop_sessions()
            return True
        return False

    def _fall_back_at_run(self, args, error: Exception) -> list[torch.Tensor]:
        ops = sorted({str(n.target) for n in self.gm.graph.nodes if n.op == "call_function"})
        shown = ", ".join(ops[:6]) + (f" and {len(ops) - 6} more" if len(ops) > 6 else "")
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:400]
        message = f"ORT failed to run group {self.name!r} ({shown}): {first_line}"
        if self.options.fallback == "raise":
            raise SessionRunError(message) from error
        warnings.warn(f"lort: {message}; the group runs in PyTorch from now on", stacklevel=3)
        self.executor, self.run_failure = Placement.PYTORCH, first_line
        self._drop_sessions()
        self._changed()
        if self.on_run_failure is not None:
            self.on_run_failure(run_failed(first_line))
        return list(self.gm(*args))

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    def forward(self, *args):
        mode = self.options.mode
        if mode == "pytorch" or self.executor == Placement.PYTORCH:
            outs = list(self.gm(*args))
        else:
            outs = self._run_ort_or_fall_back(args)
            if mode == "debug" and self.executor == Placement.ORT:
                ref = self.gm(*args)
                compare_outputs(self.name, outs, ref, self.options.rtol, self.options.atol)
        if self._identity_where:
            return tuple(outs)
        return tuple(outs[i] for i in self.compiled.where)


def run_failed(first_line: str) -> Reason:
    """The reason of a group's nodes once ORT failed to run it."""
    return Reason(ReasonKind.RUN_FAILED, f"ORT failed to run its group: {first_line}")


#: Words of ORT's (and CUDA's) errors where memory ran out: a failure of the moment
#: (another model, another process, a larger batch held the memory), not of the group.
_OUT_OF_MEMORY = ("failed to allocate", "out of memory", "bad_alloc", "bad allocation")


def out_of_memory(failure: str | None) -> bool:
    """Whether a run failure's first line (``OrtGroup.run_failure``) says that memory ran
    out. The group falls back to PyTorch in this process all the same, but the disk cache
    does not keep such a failure for later processes."""
    text = (failure or "").lower()
    return any(word in text for word in _OUT_OF_MEMORY)


def compare_outputs(name: str, outs, refs, rtol: float, atol: float) -> None:
    """Raise MismatchError naming the first output of ``name`` outside tolerance."""
    for i, (o, r) in enumerate(zip(outs, refs)):
        if o.shape != r.shape or o.dtype != r.dtype:
            raise MismatchError(name, i, float("inf"), float("inf"), rtol, atol)
        if o.numel() == 0:
            continue
        if o.dtype.is_floating_point:
            od, rd = o.detach().double(), r.detach().double()
            if torch.allclose(od, rd, rtol=rtol, atol=atol, equal_nan=True):
                continue
            diff = (od - rd).abs()
            diff = torch.where(torch.isnan(od) & torch.isnan(rd), torch.zeros_like(diff), diff)
            rel = diff / rd.abs().clamp_min(1e-12)
            raise MismatchError(name, i, diff.max().item(), rel.max().item(), rtol, atol)
        if not torch.equal(o, r):
            diff = (o.long() - r.long()).abs()
            raise MismatchError(name, i, float(diff.max().item()), float("inf"), rtol, atol)
