"""A disk cache of translated groups: the ONNX model ORT runs and the choices made by
timing (threads, executor), keyed by the group's graph, its argument spec, the library
versions, the options that change the result and the machine (``machine_key``: a choice
timed on one CPU does not hold on another).

A hit skips translation, the fusion rewrites and the timing runs; ORT still builds its
session. Entries are written to a temporary file and renamed, so processes sharing the
directory never read half an entry; the directory is kept under a size limit by
removing the least recently used entries. The directory is listed once per process and
again only when what this process wrote takes it past the limit (not at each write:
thousands of small models, ORTModule's test suites build one per case, would list a
directory of thousands of files once per group).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import threading

import torch
import torch.fx

from .._version import __version__
from ..options import Options
from ..translate.repeated import describe_value

logger = logging.getLogger("lort")

FORMAT = 1

#: Eviction takes a full directory down to this share of its limit, so that a process
#: writing at the limit lists the directory once per tenth of it, not at every write.
EVICT_TO = 0.9
#: Bytes in each cache directory as this process knows them: listed on its first write,
#: then counted up by what it writes (other processes' writes are seen at the next listing).
_known_bytes: dict[str, int] = {}
_known_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """A hash of lort's own source: an edited lort (same version number) misses the
    entries an older one wrote."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _versions() -> tuple:
    from importlib import metadata

    def version(*dists: str) -> str:
        # Read from metadata: a warm start then never imports onnxscript.
        for d in dists:
            try:
                return metadata.version(d)
            except metadata.PackageNotFoundError:
                continue
        return "absent"

    others = (
        version("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino", "onnxruntime-directml"),
        version("onnx"),
        version("onnxscript"),
        version("onnx-ir", "onnx_ir"),
    )
    return (FORMAT, __version__, _source_hash(), torch.__version__, *others)


#: /proc/cpuinfo's fields that name the CPU a timed choice was measured on.
_CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name")
#: Its flags that change which kernels ORT, MKL and oneDNN run.
_CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "fma")


def cpuinfo_fields(cpuinfo: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's fields in ``cpuinfo`` ({} where there is no such file: another
    OS). The benchmarks' machine line reads them too (benchmarks/report.py)."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


@functools.lru_cache(maxsize=1)
def _cpu(cpuinfo: str = "/proc/cpuinfo") -> tuple:
    """The CPU, as its first processor's fields and flags in ``cpuinfo`` (else what
    platform says)."""
    import platform

    fields = cpuinfo_fields(cpuinfo)
    flags = set(fields.get("flags", "").split())
    return (platform.machine(), platform.processor(), *(fields.get(k, "") for k in _CPU_FIELDS),
            *(f for f in _CPU_FLAGS if f in flags), os.cpu_count())


def machine_key() -> tuple:
    """The hardware a timed choice holds for: the CPU (vendor, family, model, the vector
    extensions that pick kernels) and, where CUDA is initialized, the GPUs' names. The
    engine measured fastest differs between machines (BERT-base's training graph: ORT
    1.33x eager on an AMD EPYC with AVX-512, 1.74x slower than eager on an Intel Xeon;
    benchmarks/results/training.md), so a cache directory shared between machines (a
    network home, a CI cache restored on another runner) keeps one entry per machine."""
    gpus = ()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gpus = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return _cpu() + gpus


def versions_key(what: str) -> str:
    """A key for a record that depends only on the library versions (e.g. the list of
    ops torch_lib translates)."""
    return hashlib.sha256(repr((what, _versions())).encode()).hexdigest()


def graph_key(gm: torch.fx.GraphModule, options: Options, what: str = "group") -> str:
    """A hash of everything that determines a group's translation and timed choices
    (``what="group"``), or a whole graph's partition (``what="plan"``)."""
    h = hashlib.sha256()
    h.update(repr((what, _versions(), _options_key(options))).encode())
    h.update(gm.code.encode())
    for n in gm.graph.nodes:
        h.update(f"{n.name}:{describe_value(n.meta.get('val'))};".encode())
    return h.hexdigest()


def _options_key(options: Options) -> tuple:
    """The options that change a translation or a timed choice (not logging, fallback
    policy, tolerances or where the cache lives), torch's thread count and the machine."""
    return (
        options.ort_fusions,
        options.graph_optimization_level,
        options.intra_op_num_threads,
        options.executor,
        options.mode == "ort",  # the executor is timed in ort mode only
        options.providers,
        options.max_group_args,
        options.decompose_conv_backward,
        options.allow_spinning, options.force_spinning_stop, options.release_openmp,
        options.share_cpu_arena,
        options.share_cuda_arena,
        options.cuda_pinned_memory,
        options.freeze,
        (options.quantize, options.quantize_block_size, options.quantize_symmetric, options.quantize_accuracy_level)
        if options.quantize else None,
        options.engines if options.executor == "auto" else (),
        torch.get_num_threads(),
        machine_key(),
    )


def inputs_key(gm: torch.fx.GraphModule, example_inputs: list, options: Options, what: str) -> str:
    """A hash of a Dynamo graph, the metadata of its inputs, the options and versions."""
    h = hashlib.sha256()
    h.update(repr((what, _versions(), _options_key(options))).encode())
    h.update(gm.code.encode())
    for a in example_inputs:
        h.update(f"{describe_value(a)}:{getattr(a, 'requires_grad', None)};".encode())
    h.update(repr(torch.is_grad_enabled()).encode())
    return h.hexdigest()


class DiskCache:
    def __init__(self, directory: str, max_bytes: int):
        self.directory = directory
        self.max_bytes = max_bytes

    @staticmethod
    def versions_key(what: str) -> str:
        return versions_key(what)

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
            meta_bytes = json.dumps({**meta, "size": len(model)}).encode()
            self._write(model_path, model)
            self._write(meta_path, meta_bytes)
            self._written(len(model) + len(meta_bytes))
        except OSError as e:
            logger.info("lort: disk cache not written (%s)", e)

    def load_record(self, key: str) -> dict | None:
        """A JSON record stored by ``store_record`` (graph plans, op lists), or None."""
        path = os.path.join(self.directory, f"{key}.rec.json")
        try:
            with open(path) as f:
                record = json.load(f)
            os.utime(path)
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def store_record(self, key: str, record: dict) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            data = json.dumps(record).encode()
            self._write(os.path.join(self.directory, f"{key}.rec.json"), data)
            self._written(len(data))
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

    def _written(self, size: int) -> None:
        """Count ``size`` bytes written; list the directory (and evict) only on this
        process's first write to it or once the count passes the limit."""
        with _known_lock:
            known = _known_bytes.get(self.directory)
            known = self._evict() if known is None else known + size
            if known > self.max_bytes:
                known = self._evict()
            _known_bytes[self.directory] = known

    def _evict(self) -> int:
        """Remove the least recently used files while the directory is over the limit
        (down to EVICT_TO of it); the bytes left."""
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
        if total <= self.max_bytes:
            return total
        for _, size, path in sorted(entries):
            if total <= self.max_bytes * EVICT_TO:
                break
            try:
                os.unlink(path)
                total -= size
            except OSError:
                pass
        return total


def for_options(options: Options) -> DiskCache | None:
    """The disk cache of ``options``, or None: off, or models changed by
    pre_ort_model_transforms (code the cache key cannot hold)."""
    if not options.disk_cache or options.pre_ort_model_transforms:
        return None
    return DiskCache(options.cache_dir, options.cache_max_mb * 1024 * 1024)
