"""Tests on two (or more) gloo ranks on localhost: a worker script run in one process
per rank, given ``rank world_size port *extra_args`` on its command line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, world_size: int = 2, extra_args=(), env: dict | None = None, timeout: float = 240) -> list[str]:
    """Run ``script`` (a path) once per rank and return each rank's output; every rank
    must exit 0 and print ``rank <r> ok``. All ranks are killed if one times out."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(rank), str(world_size), port, *map(str, extra_args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, **(env or {})),
        )
        for rank in range(world_size)
    ]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out))
    for rank, (rc, out) in enumerate(outs):
        assert rc == 0 and f"rank {rank} ok" in out, out[-4000:]
    return [out for _, out in outs]
