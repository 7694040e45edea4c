"""Translate a fusion group's GraphModule into an ONNX model with torch_lib."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import logging
import threading

import onnx
import onnx_ir as ir
import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..errors import TranslationError
from . import _compat, attention, repeated, token_layout
from .registry import registry

logger = logging.getLogger("lort")


def group_to_onnx(gm: torch.fx.GraphModule, name: str) -> ir.Model:
    """The ONNX model of a group: inputs are the placeholders, outputs the output tuple."""
    return translate_group(gm, name)[0]


def translate_group(gm: torch.fx.GraphModule, name: str, structure: str | None = None,
                    skip_norms: bool = True) -> tuple[ir.Model, object]:
    """The group's ONNX model (inputs the placeholders, outputs the output tuple), and
    its ``fuse(serializer=None)``: the model with onnxscript's ORT rewrites, as
    ``fuse_for_ort`` gives it (``skip_norms``: its argument). A group that repeats a
    layer (translate/repeated.py) is translated, and rewritten, once per distinct layer;
    inside ``shared_runs``, a group of the structure of one translated before shares
    that one's model and rewrite (``structure``: ``repeated.structure(gm.graph)`` where
    the caller has it)."""
    known = _store("groups")
    key = ((structure or repeated.structure(gm.graph)), skip_norms) if _shared is not None else None
    if key in known:
        return known[key]
    translated = _translate_group(gm, name, skip_norms)
    if key is not None:
        known[key] = translated
    return translated


def _translate_group(gm: torch.fx.GraphModule, name: str, skip_norms: bool) -> tuple[ir.Model, object]:
    try:
        runs = repeated.split(gm)
        if runs is None:
            _prepare(gm)
            model = off_compile_thread(_compat.translate_graph, gm.graph, name, registry())
            _name_io(model)
            return model, _once(functools.partial(fuse_for_ort, model, skip_norms=skip_norms))
        models = off_compile_thread(_translate_runs, runs, name)
        model = off_compile_thread(_stitched, name, gm, runs, models)
    except Exception as e:
        raise TranslationError(f"could not translate group {name!r} to ONNX: {_root_cause(e)}") from e
    return model, _once(functools.partial(_fuse_runs, name, gm, runs, models, skip_norms=skip_norms))


def _prepare(gm: torch.fx.GraphModule) -> None:
    """What translation needs of a graph first: explicit type promotion, default
    arguments written out."""
    _compat.insert_type_promotion(gm)
    _compat.fill_default_arguments(gm)


def _once(fuse):
    """``fuse`` (``fuse_for_ort``'s contract) run once: its model is kept, serialized
    anew by each call's ``serializer``. (No caller changes the model it gets.)"""
    done = []

    def fused(serializer=None):
        if not done:
            done.append(fuse(serializer=lambda m: m))
        model, counts = done[0]
        return (None, {}) if model is None else ((serializer or serialize)(model), dict(counts))

    return fused


#: Inside ``shared_runs``: each distinct run's translation (key -> model) and rewrite
#: (key -> (model, fusions)), for every group translated there.
_shared: dict[str, dict] | None = None
_shared_depth = 0
_shared_lock = threading.Lock()


@contextlib.contextmanager
def shared_runs():
    """Groups translated inside share their runs' translations and rewrites: a
    transformer's layers fall in several groups of one graph (max_group_args). What
    they share is dropped at the end (the outermost ``with``)."""
    global _shared, _shared_depth
    with _shared_lock:
        _shared_depth += 1
        if _shared is None:
            _shared = {"plain": {}, "fused": {}, "groups": {}}
    try:
        yield
    finally:
        with _shared_lock:
            _shared_depth -= 1
            if _shared_depth == 0:
                _shared = None


def _store(kind: str) -> dict:
    shared = _shared
    return shared[kind] if shared is not None else {}


def _translate_runs(runs: list, name: str) -> dict[str, ir.Model]:
    """One model per distinct run, keyed by structure."""
    models, known, new = {}, _store("plain"), 0
    for run in runs:
        if run.key not in models:
            model = known.get(run.key)
            if model is None:
                _prepare(run.gm)
                model = _compat.translate_graph(run.gm.graph, f"{name}_run{len(models)}", registry())
                _name_io(model)
                known[run.key] = model
                new += 1
            models[run.key] = model
    logger.debug("lort: %s: %d runs of its layers, %d distinct, %d translated here", name, len(runs), len(models), new)
    return models


def _stitched(name: str, gm: torch.fx.GraphModule, runs: list, models: dict[str, ir.Model]) -> ir.Model:
    model = repeated.stitch(name, gm, runs, [models[r.key] for r in runs])
    _name_io(model)
    repeated.fix_names(model)
    return model


def _fuse_runs(name: str, gm: torch.fx.GraphModule, runs: list, models: dict[str, ir.Model], serializer=None,
               skip_norms: bool = True):
    """``fuse`` of a group translated run-wise: each distinct run rewritten once (one
    whose rewrite fails stays plain), the rewritten runs stitched."""
    fused, counts, known = {}, collections.Counter(), _store("fused")
    copies = collections.Counter(r.key for r in runs)
    for key, model in models.items():
        if (key, skip_norms) not in known:
            rewritten, fired = fuse_for_ort(model, serializer=lambda m: m, skip_norms=skip_norms)
            known[(key, skip_norms)] = (model if rewritten is None else rewritten, fired)
        fused[key], fired = known[(key, skip_norms)]
        for op, n in fired.items():
            counts[op] += n * copies[key]
    try:
        model = off_compile_thread(_stitched, name, gm, runs, fused)
    except Exception as e:  # noqa: BLE001 - the rewrites are an optimization: never fatal
        logger.info("lort: %s: stitching its rewritten layers failed: %s", name, _root_cause(e))
        return None, {}
    try:
        for op, n in off_compile_thread(_compat.fuse_across_cuts, model, skip_norms).items():
            counts[op] += n
    except Exception as e:  # noqa: BLE001 - an optimization: the stitched model stands as it is
        logger.info("lort: %s: fusions across its layers' cuts failed: %s", name, _root_cause(e))
        model = off_compile_thread(_stitched, name, gm, runs, fused)
    for op, n in _tidy(model).items():  # attention's: the rotary fusion above comes first
        counts[op] += n
    return (serializer or serialize)(model), {op: n for op, n in counts.items() if n}


_WORKER_NAME = "lort-translate"
_worker: concurrent.futures.ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()


def off_compile_thread(fn, *args):
    """``fn(*args)`` on lort's one translation thread (made on first use, kept for the
    process), outside the FakeTensorMode of the compile: pure-Python work run on the
    thread Dynamo compiles on pays for Dynamo's per-thread state on every call it makes;
    onnxscript's rewrites of a 6-layer decoder's group took 5.6-5.8 s there and 1.6-1.7 s
    from ORTModule's export path, a 2-layer one 1.7-2.1 s against 0.57 s on a thread of
    its own. The caller waits; exceptions come back as raised."""
    global _worker
    if threading.current_thread().name.startswith(_WORKER_NAME):  # a nested call
        return _without_fake_mode(fn, *args)
    with _worker_lock:
        if _worker is None:
            _worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=_WORKER_NAME)
    return _worker.submit(_without_fake_mode, fn, *args).result()


def _without_fake_mode(fn, *args):
    with unset_fake_temporarily(), _quiet_dependencies():
        return fn(*args)


#: Loggers of the libraries whose passes lort runs on its translation thread.
_DEPENDENCY_LOGGERS = ("onnxscript", "onnx_ir")


@contextlib.contextmanager
def _quiet_dependencies():
    """onnxscript's and onnx-ir's loggers at ERROR while lort runs their passes: they
    log, at WARNING, what lort handles itself (a failed shape inference, with its
    traceback, that leaves the model unchanged; a constant fold skipped; an initializer
    not deduplicated), which reached users' terminals through Python's last-resort
    handler. A level the user set on one of these loggers is kept."""
    changed = []
    for name in _DEPENDENCY_LOGGERS:
        log = logging.getLogger(name)
        if log.level == logging.NOTSET:
            log.setLevel(logging.ERROR)
            changed.append(log)
    try:
        yield
    finally:
        for log in changed:
            log.setLevel(logging.NOTSET)


def serialize(model: ir.Model) -> bytes:
    return ir.serde.serialize_model(model).SerializeToString()


def deserialize(model_bytes: bytes) -> ir.Model:
    return ir.serde.deserialize_model(onnx.ModelProto.FromString(model_bytes))


def fuse_for_ort(model: ir.Model, in_place: bool = False, serializer=None,
                 skip_norms: bool = True) -> tuple[object, dict[str, int]]:
    """The model rewritten with onnxscript's ORT fusions (GELU, skip layer norm,
    attention, fused matmuls, ...), serialized by ``serializer`` (``serialize``: bytes),
    and the count of each fusion that fired; (None, {}) when the rewrite fails or
    changes the model's interface. ``model`` is not changed, unless ``in_place`` (no
    copy: a model holding frozen weights is not copied). ``skip_norms=False``: without
    the skip-norm fusions (slower on ORT's CPU kernels: _compat.SKIP_NORM_FUSIONS)."""
    copy = model if in_place else ir.serde.deserialize_model(ir.serde.serialize_model(model))
    io_names = _io_names(model)
    try:
        fused, counts = off_compile_thread(_compat.optimize_for_ort, copy, skip_norms)
    except Exception as e:  # the rewriter is an optimization: never fatal
        logger.info("lort: ORT fusion rewrites failed on %s: %s", model.graph.name, _root_cause(e))
        return None, {}
    counts = {**counts, **_tidy(fused)}
    if _io_names(fused) != io_names:
        logger.info("lort: ORT fusion rewrites changed the interface of %s; not used", model.graph.name)
        return None, {}
    return (serializer or serialize)(fused), {k: v for k, v in counts.items() if v}


def _tidy(model: ir.Model) -> dict[str, int]:
    """translate/token_layout.py's rewrites of ``model``, in place, and their counts; a
    failure is logged; the model stays valid (each step of a rewrite keeps every value)."""
    try:
        return off_compile_thread(token_layout.tidy, model)
    except Exception as e:  # noqa: BLE001 - an optimization: never fatal
        logger.info("lort: layout rewrites failed on %s: %s", model.graph.name, _root_cause(e))
        return {}


def _io_names(model: ir.Model) -> tuple[list, list]:
    return [v.name for v in model.graph.inputs], [v.name for v in model.graph.outputs]


def _name_io(model: ir.Model) -> None:
    """Stable input/output names: in_<i>, out_<i>. An output that is not a fresh value
    of its own (torch_lib translated the op to its input, as logsumexp of a 0-d tensor
    or repeat by ones; or the same value twice; or an initializer) gets an Identity, so
    that every output is a distinct value ORT writes."""
    graph = model.graph
    for i, v in enumerate(graph.inputs):
        v.name = f"in_{i}"
    seen = set()
    for i, v in enumerate(list(graph.outputs)):
        if v in seen or v.is_graph_input() or v.is_initializer():
            copy = ir.node("Identity", [v], num_outputs=1)
            graph.append(copy)
            model.opset_imports.setdefault("", _compat.OPSET)
            fresh = copy.outputs[0]
            fresh.type, fresh.shape = v.type, v.shape
            graph.outputs[i] = fresh
            v = fresh
        seen.add(v)
        v.name = f"out_{i}"
    attention.finish(model)


def _root_cause(e: BaseException) -> str:
    parts = []
    cur: BaseException | None = e
    while cur is not None and len(parts) < 4:
        msg = str(cur).strip().splitlines()
        parts.append(f"{type(cur).__name__}: {msg[0][:300] if msg else ''}")
        cur = cur.__cause__
    return " <- ".join(parts)


def freeze_inputs(model: ir.Model, arrays: dict[int, object]) -> ir.Model:
    """A copy of ``model`` in which input ``i`` of each ``arrays`` entry is an
    initializer holding that array (NumPy, by reference: external_data.serialize leaves it
    in the weight's memory), so that ORT can fold, fuse and pre-pack it. The other
    inputs keep their order."""
    frozen = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    inputs = list(frozen.graph.inputs)
    frozen.graph.inputs.clear()
    frozen.graph.inputs.extend(v for i, v in enumerate(inputs) if i not in arrays)
    for i, array in arrays.items():
        value = inputs[i]
        value.const_value = ir.Tensor(array, name=value.name)
        frozen.graph.register_initializer(value)
    return frozen
