"""Sessions whose pre-packed weights are read from one file (Options.quantize_offload_dir).

A session pre-packs the weights its kernels take in a layout of their own (MatMulNBits'
quantized blocks and sums, a float MatMul's panels) into memory of its own, one copy per
session. A decoder's ``generate`` builds several sessions over the same weights (prefill,
first decode, later decodes), so the process held one packed copy of every weight per
session, about 1 GB each for an int4 1.4B-parameter decoder.

With the option, a session is built twice. The first build writes ORT's optimized graph
with its pre-packed weights to files (``session.save_external_prepacked_constant_initializers``);
lort moves every blob of those files into one store file per process and directory,
where a blob already stored (the same bytes packed by another session) is stored once,
and rewrites the graph's references to point into the store. The second build loads that
graph: ORT maps its initializers and pre-packed weights from the store instead of
packing them in its memory. The store's pages are file-backed and clean: the kernel
reads them in on use and can drop them; every session of the store maps the same bytes,
so the packed weights exist once in memory however many sessions use them. (ORT maps a
file itself only for a session given no initializers of its own; handed the store as a
file in memory instead, one mapping for all sessions, ORT 1.31 copies the pre-packed
blobs into its heap: both measured.)

Linux counts a page in a process's resident memory once per mapping, so two sessions
over the same weights would count it twice. Once a session has run ``STREAK`` times in a
row, ``Member.activate`` drops the page tables (``MADV_DONTNEED``) of the other sessions
of the store that map blobs it maps: they read them in again from the page cache (minor
faults, 37 ms for 896 MiB) when they next run. In a ``generate``, the decode drops the
prefill's (and the first decode's) pages a few tokens in; the prefill, run once, drops
none. Dropping a clean private file mapping never changes what it reads.

The store is a file named in a directory of its own (``lort-prepacked-<pid>-*``, since ORT
opens external data by path), removed with the last session that maps it, or at exit;
one a crashed process left behind is removed by the next store made in that directory."""

from __future__ import annotations

import gc
import hashlib
import logging
import mmap
import os
import re
import shutil
import tempfile
import threading
import weakref
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort

from . import offload

logger = logging.getLogger("lort")

_ALIGN = max(mmap.ALLOCATIONGRANULARITY, 4096)
_MADV_DONTNEED = 4
_PREFIX = "lort-prepacked-"
#: Runs in a row after which a session drops the other sessions' pages over its weights.
STREAK = 8
#: External data keys ORT writes for an initializer; anything else is not understood here.
_PLAIN_KEYS = ("location", "offset", "length")

_lock = threading.RLock()  # re-entrant: a session's finalizer (Member.drop) may run in a thread holding it
#: realpath of a directory -> its live store.
_stores: dict[str, "Store"] = {}


class StoreError(Exception):
    """The optimized graph could not be moved into the store (a layout lort does not know)."""


def load(directory: str, proto: bytes, first: Callable[[], ort.SessionOptions],
         options: Callable[[], ort.SessionOptions], providers) -> ort.InferenceSession:
    """A session of ``proto`` whose initializers and pre-packed weights are mapped from the
    store in ``directory``: ``first()`` makes the options of the build that writes them,
    ``options()`` those of the session."""
    key = os.path.realpath(directory)
    with _lock:
        store = _stores.get(key)
        if store is None or store.closed:
            store = _stores[key] = Store(key)
        store.users += 1  # held until the session is registered: no close in between
    try:
        return store.load(proto, first, options, providers)
    finally:
        store.release()


def member(session: ort.InferenceSession) -> "Member | None":
    """The store mappings of a session ``load`` made, else None."""
    return getattr(session, "_lort_prepacked", None)


def _remove_stale(directory: str) -> None:
    """Stores whose process is gone (a crash: their exit handler never ran)."""
    for name in os.listdir(directory):
        m = re.fullmatch(re.escape(_PREFIX) + r"(\d+)-.*", name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        except OSError:
            pass  # alive, another user's


class Store:
    """One append-only file of blobs, each stored once by content."""

    def __init__(self, directory: str):
        _remove_stale(directory)
        self.path = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=directory)
        self.data = os.path.join(self.path, "weights.data")
        self.fd = os.open(self.data, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        st = os.fstat(self.fd)
        self.file_id = (st.st_dev, st.st_ino)
        self.size = 0
        self.index: dict[bytes, int] = {}  # digest -> offset
        self.members: list[Member] = []
        self.last: Member | None = None  # the member that ran last
        self.users = 0
        self.closed = False
        self.lock = threading.RLock()  # as _lock
        self._finalizer = weakref.finalize(self, _remove, self.path, self.fd)

    # --- building ---------------------------------------------------------------------
    def load(self, proto: bytes, first: Callable[[], ort.SessionOptions], options: Callable[[], ort.SessionOptions],
             providers) -> ort.InferenceSession:
        with self.lock:
            with tempfile.TemporaryDirectory(dir=self.path) as scratch:
                so = first()
                so.optimized_model_filepath = os.path.join(scratch, "graph.onnx")
                so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "graph.data")
                so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
                so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
                ort.InferenceSession(proto, sess_options=so, providers=providers)
                del so
                graph = onnx.load(os.path.join(scratch, "graph.onnx"), load_external_data=False)
                blobs = self._move(graph, os.path.join(scratch, "graph.data"))
            path = os.path.join(self.path, "graph.onnx")
            onnx.save(graph, path)
            before = _mappings(self.file_id)
            try:
                session = ort.InferenceSession(path, sess_options=options(), providers=providers)
            finally:
                os.unlink(path)
            regions = sorted(_mappings(self.file_id) - before)
            member = Member(self, regions, blobs)
            self.members.append(member)
            with _lock:
                self.users += 1
            weakref.finalize(session, member.drop)
            session._lort_prepacked = member
        logger.debug("lort: session mapped from %s: %d regions, %d blobs; store %.1f MiB",
                     self.data, len(regions), len(blobs), self.size / 2**20)
        return session

    def _move(self, graph: onnx.ModelProto, data_path: str) -> frozenset[int]:
        """Move every external blob of ``graph`` into the store; the store offsets it uses."""
        used = set()
        start = self.size
        data = b""  # no initializer of 1 KiB or more: no file
        if os.path.exists(data_path) and os.path.getsize(data_path):
            with open(data_path, "rb") as f:
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            view = memoryview(data)
            for tensor in _tensors(graph.graph):
                if tensor.data_location != onnx.TensorProto.EXTERNAL:
                    continue
                entries = [(e.key, e.value) for e in tensor.external_data]
                fields = dict(entries)
                if fields.get("location") != "graph.data" or any(
                        k not in _PLAIN_KEYS and not k.startswith("prepacked") for k, _ in entries):
                    raise StoreError(f"initializer {tensor.name!r}: external data {fields}")
                moved = []
                for k, v in entries:
                    if k == "location":
                        moved.append((k, os.path.basename(self.data)))
                    elif k == "offset":
                        offset = self._put(view, int(v), int(fields["length"]))
                        used.add(offset)
                        moved.append((k, str(offset)))
                    elif k.startswith("prepacked"):
                        # key|offset;length;checksum[|offset;length;checksum...]
                        name, *blobs = v.split("|")
                        parts = [name]
                        for blob in blobs:
                            o, n, checksum = blob.split(";")
                            offset = self._put(view, int(o), int(n))
                            used.add(offset)
                            parts.append(f"{offset};{n};{checksum}")
                        moved.append((k, "|".join(parts)))
                    else:
                        moved.append((k, v))
                del tensor.external_data[:]
                for k, v in moved:
                    tensor.external_data.add(key=k, value=v)
            del view
        finally:
            if not isinstance(data, bytes):
                try:
                    data.close()
                except BufferError:  # a view a raised error's traceback holds: closed when collected
                    pass
        if self.size > start:
            os.fdatasync(self.fd)  # clean pages, which the kernel can drop and read again
            os.posix_fadvise(self.fd, start, self.size - start, os.POSIX_FADV_DONTNEED)
        return frozenset(used)

    def _put(self, view: memoryview, offset: int, length: int) -> int:
        blob = view[offset:offset + length]
        digest = hashlib.blake2b(blob, digest_size=20).digest() + length.to_bytes(8, "little")
        stored = self.index.get(digest)
        if stored is None:
            stored = -(-self.size // _ALIGN) * _ALIGN
            done = 0
            while done < length:
                done += os.pwrite(self.fd, blob[done:done + (64 << 20)], stored + done)
            self.size = stored + length
            self.index[digest] = stored
        return stored

    # --- lifetime ---------------------------------------------------------------------
    def release(self) -> None:
        with _lock:
            self.users -= 1
            if self.users == 0 and not self.closed:
                self.closed = True
                self._finalizer()


def _remove(path: str, fd: int) -> None:
    os.close(fd)
    shutil.rmtree(path, ignore_errors=True)


def _tensors(graph: onnx.GraphProto):
    yield from graph.initializer
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            if a.HasField("g"):
                yield from _tensors(a.g)
            for g in a.graphs:
                yield from _tensors(g)


def _mappings(file_id: tuple[int, int]) -> set[tuple[int, int]]:
    """(start, end) of each mapping of the file ``file_id`` (device, inode) in this process."""
    found = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) < 5 or fields[4] != str(file_id[1]):
                continue
            major, minor = (int(x, 16) for x in fields[3].split(":"))
            if os.makedev(major, minor) == file_id[0]:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found.add((start, end))
    return found


def _written(start: int, end: int) -> bool:
    """Whether a page of the private file mapping [start, end) was written: a private copy,
    an anonymous page (/proc/self/pagemap: present or swapped, not a file page). Reads
    only this range's entries; smaps would walk every mapping of the process (80 ms and
    more a call)."""
    page = mmap.PAGESIZE
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        raw = os.pread(fd, (end - start) // page * 8, start // page * 8)
    finally:
        os.close(fd)
    entries = np.frombuffer(raw, dtype=np.uint64)
    in_memory = ((entries >> np.uint64(63)) | (entries >> np.uint64(62))) & np.uint64(1)
    file_page = (entries >> np.uint64(61)) & np.uint64(1)
    return bool(np.any(in_memory & (file_page ^ np.uint64(1))))


class Member:
    """One session's mappings of the store: ``activate`` before each of its runs."""

    __slots__ = ("store", "regions", "blobs", "resident", "streak", "alive", "lock", "__weakref__")

    def __init__(self, store: Store, regions: list[tuple[int, int]], blobs: frozenset[int]):
        self.store = store
        self.regions = regions
        self.blobs = blobs
        self.resident = False
        self.streak = 0
        self.alive = True
        self.lock = threading.Lock()

    def activate(self) -> None:
        """Before a run. Once this session has run ``STREAK`` times in a row (decoding, not
        a prefill between two decodes), drop the page tables of the other sessions that
        map blobs it maps: a prefill's pages leave a few tokens into the decode, and
        are read in again (minor faults) once per ``generate``, the decode's never."""
        store = self.store
        if store.last is not self:
            store.last, self.streak = self, 0
        self.resident = True
        if self.streak < STREAK:
            self.streak += 1
            if self.streak == STREAK:
                for other in list(store.members):
                    if other is not self and other.resident and not other.blobs.isdisjoint(self.blobs):
                        other.zap()

    def zap(self) -> None:
        """MADV_DONTNEED over this session's regions that still map the store, none of
        whose pages was written (ORT does not write its initializers; were it to, the
        region would keep its pages, not lose the write). Under the
        member's lock, which ``drop`` (run before ORT unmaps them) also takes, with the
        cyclic collector off, so no region is unmapped and reused in between."""
        self.resident = False
        enabled = gc.isenabled()
        gc.disable()
        try:
            with self.lock:
                if not self.alive:
                    return
                live = _mappings(self.store.file_id)
                for start, end in self.regions:
                    if any(s <= start and end <= e for s, e in live) and not _written(start, end):
                        offload.madvise(start, end - start, _MADV_DONTNEED)
        finally:
            if enabled:
                gc.enable()

    def drop(self) -> None:
        """The session is going: its regions are never touched again."""
        with self.lock:
            self.alive = False
        store = self.store
        with store.lock:
            if self in store.members:
                store.members.remove(self)
            if store.last is self:
                store.last = None
        store.release()
