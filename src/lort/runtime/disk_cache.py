"""A disk cache of translated groups: the ONNX model ORT runs and the choices made by
timing (threads, executor), keyed by the group's graph, its argument spec, the library
versions and the options that change the result.

A hit skips translation, the fusion rewrites and the timing runs; ORT still builds its
session. Entries are written to a temporary file and renamed, so processes sharing the
directory never read half an entry; the directory is kept under a size limit by
removing the least recently used entries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile

import torch
import torch.fx

from ..options import Options

logger = logging.getLogger("lort")

FORMAT = 1


def _versions() -> tuple:
    import onnx_ir
    import onnxruntime
    import onnxscript

    from .. import __version__

    return (FORMAT, __version__, torch.__version__, onnxruntime.__version__, onnxscript.__version__, onnx_ir.__version__)


def _describe(val) -> str:
    if isinstance(val, torch.Tensor):
        return f"{val.dtype}{tuple(str(d) for d in val.shape)}{tuple(str(s) for s in val.stride())}{val.device.type}"
    if isinstance(val, (list, tuple)):
        return "(" + ",".join(_describe(v) for v in val) + ")"
    return type(val).__name__


def graph_key(gm: torch.fx.GraphModule, options: Options) -> str:
    """A hash of everything that determines a group's translation and timed choices."""
    h = hashlib.sha256()
    h.update(repr(_versions()).encode())
    h.update(
        repr(
            (
                options.ort_fusions,
                options.graph_optimization_level,
                options.intra_op_num_threads,
                options.executor,
                options.mode == "ort",  # the executor is timed in ort mode only
                options.providers,
                torch.get_num_threads(),
            )
        ).encode()
    )
    h.update(gm.code.encode())
    for n in gm.graph.nodes:
        h.update(f"{n.name}:{_describe(n.meta.get('val'))};".encode())
    return h.hexdigest()


class DiskCache:
    def __init__(self, directory: str, max_bytes: int):
        self.directory = directory
        self.max_bytes = max_bytes

    def _paths(self, key: str) -> tuple[str, str]:
        return os.path.join(self.directory, f"{key}.onnx"), os.path.join(self.directory, f"{key}.json")

    def load(self, key: str) -> tuple[bytes, dict] | None:
        model_path, meta_path = self._paths(key)
        try:
            with open(meta_path) as f:
                meta = json.load(f)
            with open(model_path, "rb") as f:
                model = f.read()
        except (OSError, ValueError):
            return None
        if len(model) != meta.get("size"):
            return None
        for p in (model_path, meta_path):
            try:
                os.utime(p)  # least recently used goes first
            except OSError:
                pass
        return model, meta

    def store(self, key: str, model: bytes, meta: dict) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            model_path, meta_path = self._paths(key)
            # The model first, then the metadata that makes the entry visible.
            self._write(model_path, model)
            self._write(meta_path, json.dumps({**meta, "size": len(model)}).encode())
            self._evict()
        except OSError as e:
            logger.info("lort: disk cache not written (%s)", e)

    def _write(self, path: str, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _evict(self) -> None:
        entries = []
        total = 0
        for name in os.listdir(self.directory):
            if name.startswith(".tmp-"):
                continue
            path = os.path.join(self.directory, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            entries.append((st.st_mtime, st.st_size, path))
            total += st.st_size
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            try:
                os.unlink(path)
                total -= size
            except OSError:
                pass


def for_options(options: Options) -> DiskCache | None:
    if not options.disk_cache:
        return None
    return DiskCache(options.cache_dir, options.cache_max_mb * 1024 * 1024)
