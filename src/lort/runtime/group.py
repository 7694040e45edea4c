"""A fusion group at run time: ORT sessions cached by argument spec, and run modes."""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings

import torch
import torch.fx

from ..errors import MismatchError, SessionCreationError, SessionRunError
from ..options import Options
from ..translate import onnx_export
from . import cuda, disk_cache
from .layout import dense_perm, inverse, is_symbolic, needs_restride, physical_graph, static_shape
from .session import GroupSession, OutputSpec, measure_session
from .timing import synthetic_inputs, time_pytorch, time_session

logger = logging.getLogger("lort")

#: A group whose run takes longer than this with all threads is not timed with one.
_PARALLEL_WORK_S = 0.02
#: With executor="auto", PyTorch must be this much faster to take a group.
_PYTORCH_MARGIN = 0.9


class OrtGroup(torch.nn.Module):
    """Runs one fusion group in ORT ('ort'), PyTorch ('pytorch') or both ('debug').

    The group's ONNX model is translated once; an ORT session is built per argument
    spec (dtypes, shapes, device) and reused for every later call with that spec.
    """

    def __init__(self, name: str, gm: torch.fx.GraphModule, where: list[int] | None, options: Options):
        super().__init__()
        self.name = name
        self.gm = gm
        self.options = options
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        # where[i]: which of the module's (deduplicated) outputs is the group's output i.
        self.where = list(range(len(out_node.args[0]))) if where is None else where
        self._out_metas = [v.meta["val"] for v in out_node.args[0]]
        in_metas = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        # Permuted layouts cross into and out of ORT in physical order (see _dense_perm).
        self._in_perms = [dense_perm(m) for m in in_metas]
        self._out_perms = [dense_perm(m) for m in self._out_metas]
        self._out_inverse = [None if p is None else inverse(p) for p in self._out_perms]
        self._any_in_perm = any(p is not None for p in self._in_perms)
        self._any_out_perm = any(p is not None for p in self._out_perms)
        self._phys_gm = (
            physical_graph(gm, self._in_perms, self._out_perms) if self._any_in_perm or self._any_out_perm else gm
        )
        phys_out = next(n for n in self._phys_gm.graph.nodes if n.op == "output").args[0]
        self._outputs = [OutputSpec(v.meta["val"].dtype, static_shape(v.meta["val"])) for v in phys_out]
        # Other non-contiguous layouts (overlapping, broadcast) are copied after the run.
        self._restride = [None if p is not None else needs_restride(m) for m, p in zip(self._out_metas, self._out_perms)]
        self._any_restride = any(r is not None for r in self._restride)
        self._identity_where = where is None or list(where) == list(range(len(where)))
        devices = {m.device for m in self._out_metas}
        self.device = torch.device(next(iter(devices)))
        self.model_bytes: bytes | None = None
        self.sessions: dict[tuple, GroupSession] = {}
        # A static graph's session per numerics setting (TF32 on CUDA; always False on
        # CPU), used without computing the argument spec on each call.
        self._static_sessions: dict[bool, GroupSession] = {}
        self._cuda = self.device.type == "cuda"
        # The plain translation, kept while the ORT-fused model has not run yet: a
        # rewrite that fails at its first run falls back to it.
        self._plain_bytes: bytes | None = None
        self._cache = self._cache_key = None
        #: ORT's error when it failed to run this group (which then runs in PyTorch), or None.
        self.run_failure: str | None = None
        #: Called with the reason when ORT fails to run the group (the backend points
        #: it at the graph's record), or None.
        self.on_run_failure = None
        self.fusions: dict[str, int] = {}
        self.threads = options.intra_op_num_threads or torch.get_num_threads()
        self.thread_times: dict[int, float | None] = {}
        #: "ort" or "pytorch" (executor="auto" found PyTorch faster), and the timings.
        self.executor = "ort"
        self.executor_times: dict[str, float] = {}
        self.from_cache = False
        #: Seconds prepare() spent per step ('translate', 'session', 'timing'), for progress logs.
        self.prepare_times: dict[str, float] = {}
        # Symbolic shapes anywhere (Dynamo's dynamic shapes): the ONNX model has symbolic
        # dims and output shapes are known only after a run.
        self._dynamic = any(
            is_symbolic(n.meta.get("val")) for n in gm.graph.nodes if n.op in ("placeholder", "call_function")
        )

    # -- compile -----------------------------------------------------------------
    def prepare(self) -> None:
        """Translate to ONNX and build the session for the graph's own spec.

        With ``ort_fusions``, onnxscript's ORT fusion rewrites are applied first; if ORT
        then refuses the rewritten model, the plain translation is used. With
        ``intra_op_num_threads=None`` the thread count is chosen by timing the session
        with one thread and with torch's thread count on inputs of the real shapes.

        With the disk cache on, a group translated before (same graph, spec, versions
        and options) reuses the stored model and choices.

        Raises TranslationError or SessionCreationError."""
        # The ONNX model's inputs (physical layouts): sessions and ORT timing use these.
        metas = [n.meta.get("val") for n in self._phys_gm.graph.nodes if n.op == "placeholder"]
        cache = disk_cache.for_options(self.options)
        cache_key = disk_cache.graph_key(self.gm, self.options) if cache else None
        self._cache, self._cache_key = cache, cache_key
        if cache and self._prepare_from_cache(cache, cache_key, metas):
            self._save_onnx()
            return
        start = time.perf_counter()
        model = onnx_export.group_to_onnx(self._phys_gm, self.name)
        plain = onnx_export.serialize(model)
        candidates = [plain]
        if self.options.ort_fusions:
            fused, self.fusions = onnx_export.fuse_for_ort(model)
            if fused is not None:
                candidates.insert(0, fused)
        self.prepare_times["translate"] = time.perf_counter() - start
        tf32 = self._numerics()
        key = self._spec(metas, tf32)
        for i, model_bytes in enumerate(candidates):
            try:
                self.model_bytes = model_bytes
                with self._timed("timing"):
                    self._choose_threads(metas)
                with self._timed("session"):
                    sess = self._session(key, tf32)
                self._plain_bytes = plain if model_bytes is not plain else None
                break
            except SessionCreationError as e:
                if i == len(candidates) - 1:
                    raise
                logger.info("lort: %s: ORT refused the fused model (%s); using the plain one", self.name, e)
                self.fusions = {}
        self._save_onnx()
        if not self._dynamic:
            self._static_sessions[tf32] = sess
        if self.options.executor == "auto" and self.options.mode == "ort":
            with self._timed("timing"):
                self._choose_executor(metas, sess)
            if self.executor == "pytorch":
                self._drop_sessions()  # never run: their memory (arena, weights) goes
        self.__dict__.pop("_feeds", None)  # timing inputs are not kept alive
        if cache:
            cache.store(cache_key, self.model_bytes, self._choices())

    @contextlib.contextmanager
    def _timed(self, step: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.prepare_times[step] = self.prepare_times.get(step, 0.0) + time.perf_counter() - start

    def _drop_sessions(self) -> None:
        self.sessions.clear()
        self._static_sessions.clear()

    def _save_onnx(self) -> None:
        if self.options.save_onnx:
            os.makedirs(self.options.save_onnx, exist_ok=True)
            path = os.path.join(self.options.save_onnx, f"{self.name}.onnx")
            with open(path, "wb") as f:
                f.write(self.model_bytes)
            logger.info("lort: wrote %s", path)

    def _choices(self) -> dict:
        return {
            "threads": self.threads,
            "thread_times": {str(k): v for k, v in self.thread_times.items()},
            "fusions": self.fusions,
            "executor": self.executor,
            "executor_times": self.executor_times,
            "run_failure": self.run_failure,
        }

    def _prepare_from_cache(self, cache, cache_key: str, metas) -> bool:
        hit = cache.load(cache_key)
        if hit is None:
            return False
        model_bytes, meta = hit
        try:
            self.model_bytes = model_bytes
            self.threads = int(meta["threads"])
            self.thread_times = {int(k): v for k, v in meta["thread_times"].items()}
            self.fusions = dict(meta["fusions"])
            self.executor = meta["executor"]
            self.executor_times = dict(meta["executor_times"])
            self.run_failure = meta.get("run_failure")
            # A group timed faster in PyTorch never runs its session: none is built.
            tf32 = self._numerics()
            sess = self._session(self._spec(metas, tf32), tf32) if self.executor == "ort" else None
        except (KeyError, TypeError, ValueError, SessionCreationError) as e:
            logger.info("lort: %s: disk cache entry unusable (%s); translating", self.name, e)
            self.sessions.clear()
            return False
        if not self._dynamic and sess is not None:
            self._static_sessions[tf32] = sess
        self.from_cache = True
        logger.debug("lort: %s: loaded from the disk cache", self.name)
        return True

    def _timing_feeds(self, metas) -> list | None:
        """Synthetic inputs for the timing runs, built once per group."""
        if not hasattr(self, "_feeds"):
            self._feeds = synthetic_inputs(metas)
        return self._feeds

    def _choose_executor(self, metas, sess: GroupSession) -> None:
        """Time the group in PyTorch against its ORT time; keep the faster. On CUDA
        both are timed on device tensors, synchronized around the timed region."""
        feeds = self._timing_feeds(metas)
        if feeds is None or self.device.type not in ("cpu", "cuda"):
            return
        if self._cuda:
            ort_time = time_session(sess, feeds, self.device)
        else:
            ort_time = min((t for t in self.thread_times.values() if t is not None), default=None)
            if ort_time is None:
                ort_time = measure_session(self.model_bytes, self.device, self.options, self.threads, feeds)
        torch_time = time_pytorch(self.gm, feeds, self._in_perms, self.device)
        if ort_time is None or torch_time is None:
            return
        self.executor_times = {"ort": ort_time, "pytorch": torch_time}
        if torch_time < _PYTORCH_MARGIN * ort_time:
            self.executor = "pytorch"
            logger.info(
                "lort: %s runs in PyTorch: %.0f us there vs %.0f us in ORT", self.name, torch_time * 1e6, ort_time * 1e6
            )

    def _choose_threads(self, metas) -> None:
        self.threads = self.options.intra_op_num_threads or torch.get_num_threads()
        if self.options.intra_op_num_threads is not None or self.threads == 1 or self._dynamic or self._cuda:
            return
        feeds = self._timing_feeds(metas)
        if feeds is None:
            return
        times = {}
        for threads in (self.threads, 1):
            times[threads] = measure_session(self.model_bytes, self.device, self.options, threads, feeds)
            if times[threads] is None or times[threads] > _PARALLEL_WORK_S:
                break  # enough work to use every thread (or no measurement possible)
        self.thread_times = times
        if times.get(1) is not None and times[1] < times[self.threads]:
            self.threads = 1

    def _numerics(self) -> bool:
        """The numerics setting sessions are keyed by: whether PyTorch allows TF32 now
        (CUDA only; runtime/cuda.py)."""
        return self._cuda and cuda.tf32_enabled()

    def _spec(self, args, tf32: bool = False) -> tuple:
        """The argument spec a session is cached by. With symbolic dims in the graph the
        ONNX model has symbolic dims too, and one session serves every shape."""
        if self._dynamic:
            spec = tuple((a.dtype, a.dim(), a.device) if isinstance(a, torch.Tensor) else "scalar" for a in args)
        else:
            spec = tuple((a.dtype, tuple(a.shape), a.device) if isinstance(a, torch.Tensor) else "scalar" for a in args)
        return (*spec, ("tf32", tf32)) if self._cuda else spec

    def _session(self, key: tuple, tf32: bool = False) -> GroupSession:
        sess = self.sessions.get(key)
        if sess is None:
            assert self.model_bytes is not None
            sess = GroupSession(
                self.model_bytes, self.device, self._outputs, self.options, self.name, self.threads, tf32=tf32
            )
            self.sessions[key] = sess
            logger.debug("lort: built session %d for %s (spec %s)", len(self.sessions), self.name, key)
        return sess

    # -- run ---------------------------------------------------------------------
    def _run_ort(self, args) -> list[torch.Tensor]:
        if self._any_in_perm:
            args = [a if p is None else a.permute(p) for a, p in zip(args, self._in_perms)]
        # A static graph is only ever called with its own spec (Dynamo guards shapes,
        # dtypes and devices), so its session is used without computing the spec.
        tf32 = self._numerics()
        sess = self._static_sessions.get(tf32)
        if sess is None:
            sess = self._session(self._spec(args, tf32), tf32)
            if not self._dynamic:
                self._static_sessions[tf32] = sess
        outs = sess.run(args)
        if self._any_out_perm:
            outs = [o if q is None else o.permute(q) for o, q in zip(outs, self._out_inverse)]
        if self._any_restride:
            for i, rs in enumerate(self._restride):
                if rs is not None:
                    outs[i] = torch.empty_strided(rs[0], rs[1], dtype=outs[i].dtype, device=outs[i].device).copy_(outs[i])
        return outs

    def _run_ort_or_fall_back(self, args) -> list[torch.Tensor]:
        """ORT's outputs; where ORT fails at run time (a kernel that rejects what a
        fusion rewrite built, say), the plain translation is tried if the fused model
        failed, then the group runs in PyTorch from now on, with one warning naming its
        ops and the error (SessionRunError with fallback="raise")."""
        try:
            outs = self._run_ort(args)
        except Exception as e:  # noqa: BLE001 - any ORT run error: fall back, never a wrong result
            error = e
            if self._plain_bytes is not None:
                logger.info("lort: %s: the ORT-fused model failed to run (%s); using the plain one", self.name, e)
                self.model_bytes, self._plain_bytes, self.fusions = self._plain_bytes, None, {}
                self._drop_sessions()
                try:
                    outs = self._run_ort(args)
                    self._store_choices()
                    return outs
                except Exception as e2:  # noqa: BLE001
                    error = e2
            return self._fall_back_at_run(args, error)
        self._plain_bytes = None  # the fused model ran: nothing to fall back to
        return outs

    def _fall_back_at_run(self, args, error: Exception) -> list[torch.Tensor]:
        ops = sorted({str(n.target) for n in self.gm.graph.nodes if n.op == "call_function"})
        shown = ", ".join(ops[:6]) + (f" and {len(ops) - 6} more" if len(ops) > 6 else "")
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:400]
        message = f"ORT failed to run group {self.name!r} ({shown}): {first_line}"
        if self.options.fallback == "raise":
            raise SessionRunError(message) from error
        warnings.warn(f"lort: {message}; the group runs in PyTorch from now on", stacklevel=3)
        self.executor, self.run_failure = "pytorch", first_line
        self._drop_sessions()
        self._store_choices()
        if self.on_run_failure is not None:
            self.on_run_failure(f"ORT failed to run its group: {first_line}")
        return list(self.gm(*args))

    def _store_choices(self) -> None:
        """Keep a choice made at run time in the disk cache, so a new process does not
        run the failing model again."""
        if self._cache is not None and self.model_bytes is not None:
            self._cache.store(self._cache_key, self.model_bytes, self._choices())

    def forward(self, *args):
        mode = self.options.mode
        if mode == "pytorch" or self.executor == "pytorch":
            outs = list(self.gm(*args))
        else:
            outs = self._run_ort_or_fall_back(args)
            if mode == "debug" and self.executor == "ort":
                ref = self.gm(*args)
                compare_outputs(self.name, outs, ref, self.options.rtol, self.options.atol)
        if self._identity_where:
            return tuple(outs)
        return tuple(outs[i] for i in self.where)


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
