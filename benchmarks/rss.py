"""Resident memory of the current process, for the memory benchmarks' child processes
(benchmarks/memory.py, benchmarks/freeze_memory.py): RSS, its high-water mark and PSS
from /proc, a reset of the mark, a 1 ms sampler where the reset is not allowed, malloc_trim."""

from __future__ import annotations

import ctypes
import threading
import time


def status() -> dict:
    """VmRSS and VmHWM in bytes; Pss too where the kernel reports it (4.14+): a page mapped
    twice (two sessions mapping the same file) counts twice in RSS, once in PSS."""
    d = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":", 1)
                d[k] = int(v.split()[0]) * 1024
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    d["Pss"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return d


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    s = status()
    return s["VmHWM"] <= s["VmRSS"] + (1 << 20)


class Sampler:
    """Fallback: VmRSS read every 1 ms from a background thread."""

    def __init__(self):
        self.peak, self.stop = 0, False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop:
            self.peak = max(self.peak, status()["VmRSS"])
            time.sleep(0.001)

    def take(self):
        """The peak since the last take (and the current RSS)."""
        now = status()["VmRSS"]
        peak, self.peak = max(self.peak, now), now
        return peak

    def close(self):
        self.stop = True
        self.thread.join()


def trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
