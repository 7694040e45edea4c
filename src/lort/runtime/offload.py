"""Memory lort no longer reads, moved to a file on disk in place (Options.quantize_offload_dir).

Once a float32 weight matrix is quantized, ORT runs on the quantized copy and never reads
the float32 one; once a session has pre-packed the quantized arrays, it does not read
those either; of an embedding table a call reads only the rows of its tokens. All of it
still sits in the process's memory. ``offload`` writes such a region to an unlinked file
in a directory on disk and maps the file over the region's whole pages
at the same addresses (``mmap(MAP_PRIVATE | MAP_FIXED)``): the tensor keeps its address,
its values, its version counter and every reference to it, so nothing that holds it (the
module, Dynamo's graphs, ORT's shared initializers, lort's weight check) can tell, and
the region's pages leave the process's resident memory. A read pages the values back in
from the file; a write makes a private copy of the page, as anonymous memory does. The
file is freed with the mapping, when the memory is freed: an allocation past glibc's mmap
threshold (128 KiB, rising to at most 32 MiB) is a mapping of its own, which ``free``
unmaps; one glibc placed in its heap keeps its file (unlinked: disk space only) until
the heap shrinks below it or the process exits, and memory reused from there reads and
writes as any memory malloc returns.

``page_out`` asks the kernel to reclaim the file-backed pages a read brought back in
(``MADV_PAGEOUT``, which never changes what the memory reads: a clean page is dropped and
read again from the file; a written one stays). lort calls it after building a session
(whose pre-packing read every quantized array) and after resetting a weight check (which
read every weight to find the element it samples). ``MADV_PAGEOUT`` takes only pages on the
kernel's LRU lists; a page read in lately can still sit in the per-CPU cache of the CPU
that read it, and on an idle CPU it stays there: ``page_out`` first has the kernel drain
every CPU's cache (``_drain_lru_caches``).

The first and last partial page of a region stay where they are. Linux only; Options
checks the directory (not a tmpfs or ramfs, which would keep the file in memory)."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
import tempfile
import threading
import weakref

logger = logging.getLogger("lort")

_PAGE = mmap.PAGESIZE
_PROT_READ, _PROT_WRITE = 0x1, 0x2
_MAP_PRIVATE, _MAP_FIXED = 0x02, 0x10
_MADV_PAGEOUT = 21
#: Regions smaller than this stay in memory: not worth a file.
MIN_BYTES = 1 << 20
#: Regions at most (each splits its mapping in up to three, of Linux's 65530 a process).
MAX_REGIONS = 8192

_lock = threading.Lock()
#: start address -> length of each region mapped from a file, while its owner lives.
_regions: dict[int, int] = {}
#: (descriptor, mapping) of the page ``_drain_lru_caches`` advises on, made with the first region.
_drain_page: tuple[int, mmap.mmap] | None = None


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.madvise.restype = ctypes.c_int
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


_LIBC = _libc() if sys.platform.startswith("linux") else None


def madvise(start: int, length: int, advice: int) -> int:
    """libc's madvise over [start, start + length): 0, else -1 with errno set
    (runtime/prepacked.py drops its sessions' pages through it too)."""
    return _LIBC.madvise(start, length, advice)


def _pages(address: int, nbytes: int) -> tuple[int, int]:
    """The whole pages inside [address, address + nbytes): (start, length)."""
    start = -(-address // _PAGE) * _PAGE
    end = (address + nbytes) // _PAGE * _PAGE
    return start, max(0, end - start)


def _write_all(fd: int, start: int, length: int) -> None:
    view = memoryview((ctypes.c_ubyte * length).from_address(start)).cast("B")
    done = 0
    while done < length:
        done += os.write(fd, view[done:done + (64 << 20)])


def offload(owner, address: int, nbytes: int, directory: str) -> int:
    """Move the whole pages of the memory [address, address + nbytes), which ``owner``
    (the tensor or array holding it) keeps alive, to an unlinked file in ``directory``,
    mapped back at the same addresses. The bytes moved (0: too small, already moved, or
    the file could not be written: logged, the memory left as it was)."""
    start, length = _pages(address, nbytes)
    if _LIBC is None or length < MIN_BYTES:
        return 0
    with _lock:
        if start in _regions:
            return 0
        if len(_regions) >= MAX_REGIONS:
            logger.info("lort: %d regions offloaded already; %.1f MiB stay in memory", MAX_REGIONS, length / 2**20)
            return 0
        fd = -1
        try:
            fd, path = tempfile.mkstemp(prefix="lort-offload-", dir=directory)
            os.unlink(path)
            _write_all(fd, start, length)
            os.fdatasync(fd)  # clean pages, which the kernel can drop and read again
            os.posix_fadvise(fd, 0, length, os.POSIX_FADV_DONTNEED)
            got = _LIBC.mmap(start, length, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE | _MAP_FIXED, fd, 0)
            if got != start:
                # What fails here (EINVAL, ENOMEM for the map count) fails before anything is
                # unmapped: the memory is as it was.
                raise OSError(ctypes.get_errno(), f"mmap: {os.strerror(ctypes.get_errno())}")
        except OSError as e:
            logger.warning("lort: could not offload %.1f MiB to %s (%s); they stay in memory",
                           length / 2**20, directory, e)
            return 0
        finally:
            if fd >= 0:
                os.close(fd)
        _regions[start] = length
        if _drain_page is None:
            _make_drain_page(directory)
    weakref.finalize(owner, _forget, start)
    return length


def _make_drain_page(directory: str) -> None:
    """One clean page of an unlinked file in ``directory`` (on a disk: a tmpfs ignores the
    advice), mapped for the process's lifetime. Called under ``_lock``."""
    global _drain_page
    fd = -1
    try:
        fd, path = tempfile.mkstemp(prefix="lort-drain-", dir=directory)
        os.unlink(path)
        os.write(fd, bytes(_PAGE))
        os.fdatasync(fd)  # a dirty page would go to writeback, which the advice skips uncounted
        _drain_page = fd, mmap.mmap(fd, _PAGE, mmap.MAP_PRIVATE, mmap.PROT_READ)
    except OSError as e:
        logger.debug("lort: no page to drain the kernel's LRU caches through (%s)", e)
        if fd >= 0:
            os.close(fd)


def _drain_lru_caches() -> None:
    """Have the kernel move the pages in every CPU's LRU cache onto its LRU lists.
    ``POSIX_FADV_DONTNEED`` over a page the process maps fails to drop it, and the kernel
    answers a failure by draining every CPU's cache before it tries again (mm/fadvise.c,
    on every Linux that has MADV_PAGEOUT); the page stays. Reading it first maps it again
    if memory pressure had reclaimed it. A failure only leaves such pages resident."""
    if _drain_page is None:
        return
    fd, page = _drain_page
    page[0]
    try:
        os.posix_fadvise(fd, 0, _PAGE, os.POSIX_FADV_DONTNEED)
    except OSError as e:
        logger.debug("lort: could not drain the kernel's LRU caches (%s)", e)


def _forget(start: int) -> None:
    with _lock:
        _regions.pop(start, None)


def page_out() -> None:
    """Reclaim the pages of every offloaded region that reads brought back in (clean
    ones: a page written since stays)."""
    if _LIBC is None:
        return
    with _lock:
        regions = list(_regions.items())
        if regions:
            _drain_lru_caches()
    for start, length in regions:
        if madvise(start, length, _MADV_PAGEOUT) != 0 and ctypes.get_errno() == errno.EINVAL:
            return  # a kernel before 5.4 has no MADV_PAGEOUT: the pages stay until memory is short


def regions() -> dict[int, int]:
    """Start address -> length of each region offloaded whose owner lives."""
    with _lock:
        return dict(_regions)


def stats() -> dict:
    """Bytes and regions offloaded and still alive."""
    with _lock:
        return {"bytes": sum(_regions.values()), "regions": len(_regions)}
