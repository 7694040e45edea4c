"""A fusion group at run time: ORT sessions cached by argument spec, and run modes."""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
import torch.fx
from torch._prims_common import is_non_overlapping_and_dense_or_false

from ..errors import MismatchError, SessionCreationError
from ..options import Options
from ..translate import onnx_export
from . import disk_cache
from .session import _NP_DTYPES, GroupSession, OutputSpec, measure_session, median_run_time

logger = logging.getLogger("lort")

#: A group whose run takes longer than this with all threads is not timed with one.
_PARALLEL_WORK_S = 0.02
#: With executor="auto", PyTorch must be this much faster to take a group.
_PYTORCH_MARGIN = 0.9


def _synthetic_inputs(metas) -> list | None:
    """Inputs of the placeholders' shapes and dtypes to time a session on (NumPy, as
    compilation runs under FakeTensorMode); integer inputs are zeros (valid indices)."""
    rng = np.random.default_rng(0)
    out = []
    for m in metas:
        if not isinstance(m, torch.Tensor) or _static_shape(m) is None or m.dtype not in _NP_DTYPES:
            return None
        np_dtype = _NP_DTYPES[m.dtype]
        if m.dtype.is_floating_point:
            out.append(rng.standard_normal(_static_shape(m)).astype(np_dtype))
        else:
            out.append(np.zeros(_static_shape(m), dtype=np_dtype))
    return out


def _static_shape(t: torch.Tensor) -> tuple[int, ...] | None:
    dims = []
    for d in t.shape:
        if not isinstance(d, int):
            return None
        dims.append(d)
    return tuple(dims)


def _time_pytorch(gm: torch.fx.GraphModule, feeds: list, perms: list) -> float | None:
    """Median seconds of a run of ``gm`` on ``feeds`` (real tensors: compilation runs
    under FakeTensorMode, which this leaves for the measurement); feeds are in physical
    order, ``perms`` gives each input back its layout."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        args = [
            torch.from_numpy(f) if p is None else torch.from_numpy(f).permute(_inverse(p))
            for f, p in zip(feeds, perms)
        ]
        return median_run_time(lambda: gm(*args))


def _is_symbolic(val) -> bool:
    if isinstance(val, (list, tuple)):
        return any(_is_symbolic(v) for v in val)
    return isinstance(val, torch.SymInt) or (isinstance(val, torch.Tensor) and _static_shape(val) is None)


def _needs_restride(t: torch.Tensor) -> tuple | None:
    """The meta strides of an output when they are static, dense and not contiguous
    (a permuted layout that PyTorch code after the group may rely on)."""
    shape = _static_shape(t)
    if shape is None or t.is_contiguous():
        return None
    if not is_non_overlapping_and_dense_or_false(t):
        return None
    try:
        stride = tuple(int(s) for s in t.stride())
    except (TypeError, RuntimeError):
        return None
    return shape, stride


def _dense_perm(t) -> list[int] | None:
    """For a tensor whose layout is a permutation of a contiguous one (a transposed
    weight, a channels-last activation), the permutation ``p`` such that
    ``t.permute(p)`` is contiguous; None for contiguous, symbolic or other layouts.

    Groups take and give such tensors in their physical order, with the Transpose
    inside the ONNX model (where ORT folds it into MatMul or Gemm), instead of copying
    them to or from contiguous memory."""
    if not isinstance(t, torch.Tensor) or _needs_restride(t) is None:
        return None
    stride = [int(s) for s in t.stride()]
    perm = sorted(range(t.dim()), key=lambda d: (-stride[d], d))
    if not t.permute(perm).is_contiguous() or perm == list(range(t.dim())):
        return None
    return perm


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def _physical_graph(gm: torch.fx.GraphModule, in_perms: list, out_perms: list) -> torch.fx.GraphModule:
    """A copy of ``gm`` that takes permuted-layout inputs and gives permuted-layout
    outputs in physical (contiguous) order, with permutes inside the graph."""
    graph = torch.fx.Graph()
    val_map: dict = {}
    out = graph.graph_copy(gm.graph, val_map)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, perm in zip(placeholders, in_perms):
        if perm is None:
            continue
        logical = node.meta["val"]
        with graph.inserting_after(node):
            view = graph.call_function(torch.ops.aten.permute.default, (node, _inverse(perm)))
        node.replace_all_uses_with(view, delete_user_cb=lambda u: u is not view)
        node.meta = {**node.meta, "val": logical.permute(perm).contiguous()}
        view.meta = {"val": logical}
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    for i, perm in enumerate(out_perms):
        if perm is None:
            continue
        logical = outs[i].meta["val"]
        phys = graph.call_function(torch.ops.aten.permute.default, (outs[i], perm))
        phys.meta = {"val": logical.permute(perm).contiguous()}
        outs[i] = phys
    graph.output(tuple(outs))
    return torch.fx.GraphModule(gm, graph)


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
        self._in_perms = [_dense_perm(m) for m in in_metas]
        self._out_perms = [_dense_perm(m) for m in self._out_metas]
        self._out_inverse = [None if p is None else _inverse(p) for p in self._out_perms]
        self._any_in_perm = any(p is not None for p in self._in_perms)
        self._any_out_perm = any(p is not None for p in self._out_perms)
        self._phys_gm = (
            _physical_graph(gm, self._in_perms, self._out_perms) if self._any_in_perm or self._any_out_perm else gm
        )
        phys_out = next(n for n in self._phys_gm.graph.nodes if n.op == "output").args[0]
        self._outputs = [OutputSpec(v.meta["val"].dtype, _static_shape(v.meta["val"])) for v in phys_out]
        # Other non-contiguous layouts (overlapping, broadcast) are copied after the run.
        self._restride = [None if p is not None else _needs_restride(m) for m, p in zip(self._out_metas, self._out_perms)]
        self._any_restride = any(r is not None for r in self._restride)
        self._identity_where = where is None or list(where) == list(range(len(where)))
        devices = {m.device for m in self._out_metas}
        self.device = torch.device(next(iter(devices)))
        self.model_bytes: bytes | None = None
        self.sessions: dict[tuple, GroupSession] = {}
        self._static_session: GroupSession | None = None
        self.fusions: dict[str, int] = {}
        self.threads = options.intra_op_num_threads or torch.get_num_threads()
        self.thread_times: dict[int, float | None] = {}
        #: "ort" or "pytorch" (executor="auto" found PyTorch faster), and the timings.
        self.executor = "ort"
        self.executor_times: dict[str, float] = {}
        self.from_cache = False
        # Symbolic shapes anywhere (Dynamo's dynamic shapes): the ONNX model has symbolic
        # dims and output shapes are known only after a run.
        self._dynamic = any(
            _is_symbolic(n.meta.get("val")) for n in gm.graph.nodes if n.op in ("placeholder", "call_function")
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
        if cache and self._prepare_from_cache(cache, cache_key, metas):
            self._save_onnx()
            return
        model = onnx_export.group_to_onnx(self._phys_gm, self.name)
        plain = onnx_export.serialize(model)
        candidates = [plain]
        if self.options.ort_fusions:
            fused, self.fusions = onnx_export.fuse_for_ort(model)
            if fused is not None:
                candidates.insert(0, fused)
        key = self._spec(metas)
        for i, model_bytes in enumerate(candidates):
            try:
                self.model_bytes = model_bytes
                self._choose_threads(metas)
                sess = self._session(key)
                break
            except SessionCreationError as e:
                if i == len(candidates) - 1:
                    raise
                logger.info("lort: %s: ORT refused the fused model (%s); using the plain one", self.name, e)
                self.fusions = {}
        self._save_onnx()
        if not self._dynamic:
            self._static_session = sess
        if self.options.executor == "auto" and self.options.mode == "ort":
            self._choose_executor(metas)
            if self.executor == "pytorch":
                self._drop_sessions()  # never run: their memory (arena, weights) goes
        self.__dict__.pop("_feeds", None)  # timing inputs are not kept alive
        if cache:
            cache.store(cache_key, self.model_bytes, self._choices())

    def _drop_sessions(self) -> None:
        self.sessions.clear()
        self._static_session = None

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
            # A group timed faster in PyTorch never runs its session: none is built.
            sess = self._session(self._spec(metas)) if self.executor == "ort" else None
        except (KeyError, TypeError, ValueError, SessionCreationError) as e:
            logger.info("lort: %s: disk cache entry unusable (%s); translating", self.name, e)
            self.sessions.clear()
            return False
        if not self._dynamic:
            self._static_session = sess
        self.from_cache = True
        logger.debug("lort: %s: loaded from the disk cache", self.name)
        return True

    def _timing_feeds(self, metas) -> list | None:
        """Synthetic inputs for the timing runs, built once per group."""
        if not hasattr(self, "_feeds"):
            self._feeds = _synthetic_inputs(metas)
        return self._feeds

    def _choose_executor(self, metas) -> None:
        """Time the group in PyTorch against its ORT time; keep the faster."""
        feeds = self._timing_feeds(metas)
        ort_time = min((t for t in self.thread_times.values() if t is not None), default=None)
        if feeds is None or self.device.type != "cpu":
            return
        if ort_time is None:
            ort_time = measure_session(self.model_bytes, self.device, self.options, self.threads, feeds)
        torch_time = _time_pytorch(self.gm, feeds, self._in_perms)
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
        if self.options.intra_op_num_threads is not None or self.threads == 1 or self._dynamic:
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

    def _spec(self, args) -> tuple:
        """The argument spec a session is cached by. With symbolic dims in the graph the
        ONNX model has symbolic dims too, and one session serves every shape."""
        if self._dynamic:
            return tuple((a.dtype, a.dim(), a.device) if isinstance(a, torch.Tensor) else "scalar" for a in args)
        return tuple((a.dtype, tuple(a.shape), a.device) if isinstance(a, torch.Tensor) else "scalar" for a in args)

    def _session(self, key: tuple) -> GroupSession:
        sess = self.sessions.get(key)
        if sess is None:
            assert self.model_bytes is not None
            sess = GroupSession(self.model_bytes, self.device, self._outputs, self.options, self.name, self.threads)
            self.sessions[key] = sess
            logger.debug("lort: built session %d for %s (spec %s)", len(self.sessions), self.name, key)
        return sess

    # -- run ---------------------------------------------------------------------
    def _run_ort(self, args) -> list[torch.Tensor]:
        # A static graph is only ever called with its own spec (Dynamo guards shapes,
        # dtypes and devices), so its one session is used without computing the spec.
        if self._any_in_perm:
            args = [a if p is None else a.permute(p) for a, p in zip(args, self._in_perms)]
        sess = self._static_session or self._session(self._spec(args))
        outs = sess.run(args)
        if self._any_out_perm:
            outs = [o if q is None else o.permute(q) for o, q in zip(outs, self._out_inverse)]
        if self._any_restride:
            for i, rs in enumerate(self._restride):
                if rs is not None:
                    outs[i] = torch.empty_strided(rs[0], rs[1], dtype=outs[i].dtype, device=outs[i].device).copy_(outs[i])
        return outs

    def forward(self, *args):
        mode = self.options.mode
        if mode == "pytorch" or self.executor == "pytorch":
            outs = list(self.gm(*args))
        elif mode == "ort":
            outs = self._run_ort(args)
        else:
            outs = self._run_ort(args)
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
