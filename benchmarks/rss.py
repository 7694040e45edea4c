"""Resident memory of the current process, for the memory benchmarks' child processes
(benchmarks/memory.py, benchmarks/freeze_memory.py): RSS and its high-water mark from
/proc, a reset of the mark, a 1 ms sampler where the reset is not allowed, malloc_trim."""

from __future__ import annotations

import ctypes
import threading
import time


def status() -> dict:
    d = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":", 1)
                d[k] = int(v.split()[0]) * 1024
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
