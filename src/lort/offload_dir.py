"""Whether a directory can take memory offloaded to files (Options.quantize_offload_dir)."""

from __future__ import annotations

import os
import sys


def problem(directory) -> str | None:
    """Why ``directory`` cannot take offloaded memory (Options.quantize_offload_dir), or None."""
    if not sys.platform.startswith("linux"):
        return f"offloading maps files over memory with Linux's mmap; this is {sys.platform}"
    if not isinstance(directory, (str, os.PathLike)):
        return "it is not a directory path"
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return "no such directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return "the directory is not writable"
    real, best, kind = os.path.realpath(directory), "", None
    try:
        with open("/proc/mounts") as f:  # the filesystem of the longest mount point above it
            for fields in (line.split() for line in f):
                point = fields[1].replace("\\040", " ") if len(fields) > 2 else None
                if point and (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        pass
    if kind in ("tmpfs", "ramfs", "devtmpfs", "hugetlbfs"):
        return f"it is on {kind}, which keeps its files in memory: choose a directory on a disk"
    return None
