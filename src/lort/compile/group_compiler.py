"""Compiling one fusion group: FX graph -> ``CompiledGroup`` (runtime/compiled.py).

Translates to ONNX (``lort.translate``), applies onnxscript's ORT fusion rewrites
(falling back to the plain translation if ORT refuses the fused model), builds the
session for the graph's own spec, and lets the tuner choose threads and, with
executor="auto", between ORT and PyTorch. With the disk cache on, a group compiled
before (same graph, spec, versions and options) reuses the stored model and choices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import warnings

import onnx
import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .. import ort_model
from ..errors import SessionCreationError
from ..numpy_views import numpy_view
from ..options import Options
from ..reasons import Placement
from ..runtime import cuda
from ..runtime.compiled import Boundary, CompiledGroup, spec_key
from ..runtime.dtypes import SUPPORTED_DTYPES
from ..runtime.group import out_of_memory
from ..runtime.session import GroupSession, OutputSpec, optimizer_changes
from ..runtime.session import stats as session_stats
from ..translate import external_data, onnx_export, repeated
from . import disk_cache, freezing, shared_sessions
from .group_choices import GroupChoices
from .layout import dense_perm, inverse, is_symbolic, needs_restride, physical_graph, static_shape
from .timing_inputs import synthetic_inputs
from .tuner import Tuner

logger = logging.getLogger("lort")


def boundary(gm: torch.fx.GraphModule) -> tuple[Boundary, torch.fx.GraphModule]:
    """How tensors cross the group's boundary, and the graph in physical layouts
    (permuted layouts cross into and out of ORT in physical order)."""
    out_metas = [v.meta["val"] for v in next(n for n in gm.graph.nodes if n.op == "output").args[0]]
    in_metas = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    in_perms = [dense_perm(m) for m in in_metas]
    out_perms = [dense_perm(m) for m in out_metas]
    any_perm = any(p is not None for p in in_perms + out_perms)
    phys_gm = physical_graph(gm, in_perms, out_perms) if any_perm else gm
    phys_out = next(n for n in phys_gm.graph.nodes if n.op == "output").args[0]
    dynamic = any(is_symbolic(n.meta.get("val")) for n in gm.graph.nodes if n.op in ("placeholder", "call_function"))
    b = Boundary(
        in_perms=tuple(in_perms),
        out_inverse=tuple(None if p is None else inverse(p) for p in out_perms),
        # Other non-contiguous layouts (overlapping, broadcast) are copied after the run.
        restride=tuple(None if p is not None else needs_restride(m) for m, p in zip(out_metas, out_perms)),
        outputs=tuple(OutputSpec(v.meta["val"].dtype, static_shape(v.meta["val"])) for v in phys_out),
        dynamic=dynamic,
    )
    return b, phys_gm


class GroupCompiler(GroupChoices):
    """Compiles groups for one options set with one tuner."""

    def __init__(self, options: Options, tuner: Tuner):
        self.options = options
        self.tuner = tuner
        self.cache = disk_cache.for_options(options)
        #: Inside ``alike()``: the groups compiled so far, by structure and spec key.
        self._twins: dict | None = None

    @contextlib.contextmanager
    def alike(self):
        """Groups compiled inside (one graph's) share their translation, rewrites and
        timed choices with an earlier group of the same structure and input spec: a
        transformer's layers fall in many alike groups (cut by dropout, by
        max_group_args), each timed once instead of once per layer."""
        outer = self._twins
        if outer is None:
            self._twins = {}
        try:
            with onnx_export.shared_runs():
                yield
        finally:
            if outer is None:
                self._twins = None

    def unbuilt(self, name: str, gm: torch.fx.GraphModule, where: list[int] | None) -> CompiledGroup:
        """A group that is never translated (mode "pytorch" runs its FX graph)."""
        b, _ = boundary(gm)
        return CompiledGroup(name, gm, _where(gm, where), _device(gm), b, threads=self._max_threads())

    def compile(
        self, name: str, gm: torch.fx.GraphModule, where: list[int] | None, times: dict | None = None,
        weights: dict[int, tuple[str, torch.Tensor]] | None = None, refused: str | None = None,
        real: dict[int, torch.Tensor] | None = None, inference: bool = False,
    ) -> CompiledGroup:
        """The compiled group. ``times`` (if given) gets the seconds per step, also on
        failure. ``weights`` (input index -> (name, tensor)): inputs to freeze into the
        session as ORT initializers where they can be; ``refused``: why none is (the
        graph's weights exceed Options.freeze_max_mb), or None; ``real`` (input index ->
        tensor): inputs whose own values timing runs read instead of synthetic ones;
        ``inference``: the group belongs to an inference graph (Tuner.left_to_graph).
        Raises TranslationError or SessionCreationError."""
        times = {} if times is None else times
        b, phys_gm = boundary(gm)
        device = _device(gm)
        if self.options.pre_ort_model_transforms:  # they change the model ORT runs, not its weights
            refused = refused or "pre_ort_model_transforms are set (weights stay inputs, as in DORT)"
        frozen, kept = freezing.choose(weights, b, device, auto=self.options.freeze == "auto", refused=refused)
        # The ONNX model's inputs (physical layouts): sessions and ORT timing use these.
        metas = [n.meta.get("val") for n in phys_gm.graph.nodes if n.op == "placeholder"]
        fields = dict(name=name, gm=gm, where=_where(gm, where), device=device, boundary=b, prepare_times=times)
        tf32 = device.type == "cuda" and cuda.tf32_enabled(cuda.tf32_kinds(gm))
        key = spec_key(metas, b.dynamic, device.type == "cuda", tf32)
        # A frozen group's entry holds its plain model (weights as inputs) and choices:
        # a warm compile freezes the current weights into it.
        cache = self.cache
        cache_key = self._cache_key(gm, frozen) if cache else None
        cached = self._from_cache(cache_key, fields, key, tf32, frozen, kept) if cache else None
        if cached is not None:
            self._save_onnx(name, cached.model_bytes)
            return cached
        twin_key = structure = None
        if self._twins is not None:
            structure = repeated.structure(phys_gm.graph)
            twin_key = (structure, key, tuple(w.index for w in frozen), str(device))
        twin = self._twins.get(twin_key) if twin_key is not None else None
        with _timed(times, "translate"):
            model, fuse = onnx_export.translate_group(phys_gm, name, structure, skip_norms=_skip_norms(device))
            plain = onnx_export.serialize(model)
        # What runs after the fused model fails (weights are never frozen with transforms).
        plain_run = self._transformed(plain, name)
        if frozen:
            candidates = freezing.candidates(model, frozen, self.options, fuse=fuse)
        else:
            candidates = ([lambda: _fused(fuse)] if self.options.ort_fusions else []) + [lambda: (plain, {})]
        feeds = synthetic_inputs(metas, _real_feeds(real, b.in_perms))
        # What the session takes: the frozen weights are its initializers.
        frozen_idx = {w.index for w in frozen}
        ort_feeds = None if feeds is None else [f for i, f in enumerate(feeds) if i not in frozen_idx]
        alike = False  # this group takes a twin's choices (for the same model, fused or plain)
        least = self._surely_long(name, gm, device, b.dynamic, inference) if twin is None else None
        for i, make in enumerate(candidates):
            with _timed(times, "translate"):
                made = make()  # the ORT-fused model, or the plain one
            if made is None:
                continue
            model_bytes, fusions = made
            fused = i < len(candidates) - 1  # the plain model is the last candidate
            try:
                model_bytes = plain_run if model_bytes is plain else self._transformed(model_bytes, name)
            except SessionCreationError as e:
                if i == len(candidates) - 1:
                    raise
                logger.info("lort: %s: %s; using the plain model", name, e)
                continue
            try:
                # The group's session with every thread also times that count: a group
                # whose session is built once (and its frozen weights pre-packed once)
                # unless one thread wins.
                alike = twin is not None and twin.fused == fused
                first_threads = twin.threads if alike else self._max_threads()
                with _timed(times, "session"):
                    sess = GroupSession(model_bytes, device, b.outputs, self.options, name, first_threads,
                                        tf32=tf32, count=False)
                with _timed(times, "timing"):
                    threads, thread_times = (
                        (twin.threads, twin.thread_times) if alike else (first_threads, {}) if least is not None
                        else self._choose_threads(model_bytes, device, ort_feeds, b.dynamic, sess)
                    )
                if threads != first_threads:
                    del sess
                    with _timed(times, "session"):
                        sess = GroupSession(model_bytes, device, b.outputs, self.options, name, threads, tf32=tf32)
                else:
                    session_stats.add_session()
                break
            except SessionCreationError as e:
                if i == len(candidates) - 1:
                    raise
                logger.info("lort: %s: ORT refused the fused model (%s); using the plain one", name, e)
        executor, executor_times = Placement.ORT, {}
        timed = self.options.executor == "auto" and self.options.mode == "ort"  # ORT or PyTorch by timing
        if alike:
            executor, executor_times = twin.executor, twin.executor_times
        elif least is not None:
            executor_times = {"ort_lower_bound": least} if timed else {}
        elif timed and feeds is not None:
            with _timed(times, "timing"):
                executor, executor_times = self._choose_executor(
                    name, gm, b, sess, feeds, ort_feeds, model_bytes, threads, thread_times, inference
                )
        ort_optimizer = self._ort_optimizer(model_bytes, device, threads, tf32) if executor == Placement.ORT else {}
        if frozen:
            self._save_onnx(name, model_bytes)
            # What runs if the weights are unfrozen: the plain model, weights as inputs.
            model_bytes, plain_bytes = plain, None
        else:
            plain_bytes = plain_run if fused else None
        compiled = CompiledGroup(
            **fields, model_bytes=model_bytes, plain_bytes=plain_bytes,
            fusions=fusions, fused=fused, threads=threads, thread_times=thread_times, executor=executor,
            executor_times=executor_times,
            # A group that runs in PyTorch never runs its session: its memory goes.
            session=sess if executor == Placement.ORT else None, session_key=key,
            frozen=frozen if executor == Placement.ORT else (), freeze_sample=self.options.freeze == "auto",
            kept_inputs=kept, ort_optimizer=ort_optimizer,
        )
        if not frozen:
            self._save_onnx(name, compiled.model_bytes)
        if twin_key is not None and twin is None:
            self._twins[twin_key] = compiled
        if cache:
            cache.store(cache_key, compiled.model_bytes, choices(compiled))
            if compiled.session is not None:
                shared_sessions.put(
                    shared_sessions.key(cache_key, self.options, device, threads, tf32, compiled.frozen), compiled.session)
        return compiled

    def refreezer(self, compiled: CompiledGroup):
        """For a group with frozen weights: the function the runtime calls with the
        current weights (and TF32 setting) to get a session holding them, or None."""
        if not compiled.frozen:
            return None
        b, name = compiled.boundary, compiled.name

        def refreeze(tensors: list, tf32: bool) -> GroupSession | None:
            start = time.perf_counter()
            try:
                sess, _ = self._frozen_session(
                    compiled.model_bytes, compiled.fused, compiled.frozen, tensors, compiled.device,
                    b.outputs, name, compiled.threads, tf32,
                )
            except Exception as e:  # noqa: BLE001 - the runtime unfreezes the weights instead
                logger.info("lort: %s: freezing the weights again failed (%s)", name, e)
                return None
            logger.info("lort: %s: weights frozen again in %.3f s", name, time.perf_counter() - start)
            return sess

        return refreeze

    def remember(self, group) -> None:
        """Store a group's run-time change (its model or executor) in the disk cache, so
        that a new process does not run the failing model again (``OrtGroup.on_change``).
        A run that failed for want of memory is not stored: a later process, with its
        memory free, tries ORT again."""
        if not self.cache or group.model_bytes is None:
            return
        if out_of_memory(group.run_failure):
            logger.info("lort: %s: ORT ran out of memory (%s); the disk cache keeps the group in ORT for "
                        "later processes", group.name, group.run_failure)
            return
        key = self._cache_key(group.gm, group.compiled.frozen)
        self.cache.store(key, group.model_bytes, choices(group.compiled, group))

    def _cache_key(self, gm: torch.fx.GraphModule, frozen) -> str:
        what = "group" if not frozen else "group frozen " + ",".join(str(w.index) for w in frozen)
        return disk_cache.graph_key(gm, self.options, what=what)

    def _frozen_session(self, plain_bytes, fused, frozen, tensors, device, outputs, name, threads, tf32):
        """A session of the plain model ``plain_bytes`` with ``frozen`` weights as
        initializers holding ``tensors`` (theirs when None), ORT-fused when ``fused``
        (the plain frozen model where ORT refuses the fused one), and the model it runs."""
        options = self.options if fused else dataclasses.replace(self.options, ort_fusions=False)
        models = freezing.candidates(onnx_export.deserialize(plain_bytes), frozen, options, tensors,
                                     skip_norms=_skip_norms(device))
        for i, make in enumerate(models):
            made = make()
            if made is None:
                continue
            try:
                return GroupSession(made[0], device, outputs, self.options, name, threads, tf32=tf32), made[0]
            except SessionCreationError:
                if i == len(models) - 1:
                    raise
        raise AssertionError("unreachable")

    def _transformed(self, model, name: str):
        """``model`` (bytes or an OnnxModel) after Options.pre_ort_model_transforms.
        Raises SessionCreationError naming the transform that failed."""
        transforms = self.options.pre_ort_model_transforms
        if not transforms:
            return model
        proto = onnx.ModelProto.FromString(ort_model.model_bytes(model))
        for i, transform in enumerate(transforms):
            try:
                transform(proto)
            except Exception as e:  # noqa: BLE001 - the user's code: a clear error, then the fallback
                what = getattr(transform, "__qualname__", repr(transform))
                raise SessionCreationError(
                    f"pre_ort_model_transforms[{i}] ({what}) raised on group {name}: {type(e).__name__}: {e}"
                ) from e
        data = proto.SerializeToString()
        return dataclasses.replace(model, proto=data) if isinstance(model, ort_model.OnnxModel) else data

    def _ort_optimizer(self, model_bytes: bytes, device, threads: int, tf32: bool) -> dict[str, int]:
        """With Options.record_ort_graph: how ORT's optimizer changes the group's graph."""
        if not self.options.record_ort_graph:
            return {}
        try:
            return optimizer_changes(model_bytes, device, self.options, threads, tf32)
        except Exception as e:  # noqa: BLE001 - a diagnostic: never fails the compile
            logger.info("lort: could not read ORT's optimized graph (%s)", e)
            return {}

    def _from_cache(self, cache_key: str, fields: dict, key: tuple, tf32: bool, frozen, kept) -> CompiledGroup | None:
        hit = self.cache.load(cache_key)
        if hit is None:
            return None
        model_bytes, meta = hit
        name, device, outputs = fields["name"], fields["device"], fields["boundary"].outputs
        try:
            executor = Placement(meta["executor"])
            threads = int(meta["threads"])
            fusions = dict(meta["fusions"])
            fused = bool(meta["fused"])
            # A group timed faster in PyTorch never runs its session: none is built.
            ort_optimizer = {}
            shared_key = shared_sessions.key(cache_key, self.options, device, threads, tf32, frozen)
            shared = shared_sessions.get(shared_key) if executor == Placement.ORT else None
            if executor != Placement.ORT:
                sess, frozen = None, ()
            elif shared is not None:  # an earlier compile's, with equal options
                sess = shared
                logger.debug("lort: %s: shares the session of an earlier compile with equal options", name)
            elif frozen:
                sess, run_bytes = self._frozen_session(
                    model_bytes, fused, frozen, None, device, outputs, name, threads, tf32
                )
                ort_optimizer = self._ort_optimizer(run_bytes, device, threads, tf32)
            else:
                sess = GroupSession(model_bytes, device, outputs, self.options, name, threads, tf32=tf32)
                ort_optimizer = self._ort_optimizer(model_bytes, device, threads, tf32)
            compiled = CompiledGroup(
                **fields, model_bytes=model_bytes, fusions=fusions, fused=fused, threads=threads,
                thread_times={int(k): v for k, v in meta["thread_times"].items()}, executor=executor,
                executor_times=dict(meta["executor_times"]), run_failure=meta.get("run_failure"),
                from_cache=True, session_key=key, session=sess, frozen=frozen,
                freeze_sample=self.options.freeze == "auto", kept_inputs=kept, ort_optimizer=ort_optimizer,
            )
        except (KeyError, TypeError, ValueError, SessionCreationError) as e:
            logger.info("lort: %s: disk cache entry unusable (%s); translating", name, e)
            return None
        if sess is not None and shared is None:
            shared_sessions.put(shared_key, sess)
        logger.debug("lort: %s: loaded from the disk cache", name)
        if compiled.run_failure and executor == Placement.PYTORCH:
            # Said at the failure, in the process it happened in; said again here, once
            # per process, or the group would run in PyTorch with nothing to say why.
            warnings.warn(
                f"lort: group {name!r} runs in PyTorch: ORT failed to run it in an earlier process "
                f"({compiled.run_failure}), as lort's disk cache at {self.cache.directory!r} records; "
                "remove that directory, or compile with disk_cache=False, to try ORT again",
                stacklevel=2,
            )
        return compiled

    def _save_onnx(self, name: str, model) -> None:
        """With Options.save_onnx: write the model a group runs (frozen weights as ONNX
        external data in a file beside it)."""
        if self.options.save_onnx:
            os.makedirs(self.options.save_onnx, exist_ok=True)
            path = os.path.join(self.options.save_onnx, f"{name}.onnx")
            external_data.save(model, path)
            logger.info("lort: wrote %s", path)


def choices(compiled: CompiledGroup, current=None) -> dict:
    """The disk cache's record of a group's choices (``current``: the run-time group,
    whose fusions, executor and run failure may have changed since compiling)."""
    now = current if current is not None else compiled
    return {
        "threads": compiled.threads,
        "thread_times": {str(k): v for k, v in compiled.thread_times.items()},
        "fusions": now.fusions,
        "fused": now.fused,
        "executor": str(now.executor),
        "executor_times": compiled.executor_times,
        "run_failure": now.run_failure,
    }


@contextlib.contextmanager
def _timed(times: dict, step: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        times[step] = times.get(step, 0.0) + time.perf_counter() - start


def _fused(fuse) -> tuple[bytes, dict] | None:
    fused, fusions = fuse()
    return None if fused is None else (fused, fusions)


def _real_feeds(real: dict | None, perms) -> dict:
    """NumPy arrays over the inputs' own memory (no copy) for timing: CPU tensors that
    enter the group as they are laid out (never a tensor subclass, such as a DTensor)."""
    out = {}
    with unset_fake_temporarily():
        for i, t in (real or {}).items():
            if type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and perms[i] is None and t.is_contiguous() and t.dtype in SUPPORTED_DTYPES:
                out[i] = numpy_view(t)
    return out


def _where(gm: torch.fx.GraphModule, where: list[int] | None) -> tuple[int, ...]:
    if where is not None:
        return tuple(where)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    return tuple(range(len(out_node.args[0])))


def _device(gm: torch.fx.GraphModule) -> torch.device:
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    return torch.device(out_node.args[0][0].meta["val"].device)


def _skip_norms(device: torch.device) -> bool:
    """Whether a group on ``device`` gets onnxscript's skip-norm fusions: not on CPU, where
    ORT's SkipLayerNormalization kernels run slower than the ops they fuse
    (translate/_compat.py: SKIP_NORM_FUSIONS)."""
    return device.type != "cpu"
