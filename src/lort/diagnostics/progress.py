"""Progress of a compile: INFO lines per graph, and a bar over the groups of big graphs.

A cold compile of a ResNet-50 training step takes about a minute on 2 cores; with
``logging.basicConfig(level=logging.INFO)`` each graph then says what it is doing::

    lort: g1_forward: captured 312 ATen nodes in 0.41 s
    lort: g1_forward: translated 3 group(s) (298 ATen nodes) to ONNX in 1.20 s
    lort: g1_forward: built 3 ORT session(s) in 0.30 s
    lort: g1_forward: timed 3 group(s) (ORT threads) in 0.50 s

and a graph of many groups shows a tqdm bar over them when stderr is a terminal.
``Options.progress`` (env ``LORT_PROGRESS=0``) turns both off.
"""

from __future__ import annotations

import logging
import sys
import time

import torch.fx

from ..reasons import Placement
from .records import is_aten_node

logger = logging.getLogger("lort")

#: A graph with at least this many groups shows a progress bar over them.
BAR_MIN_GROUPS = 8


def aten_nodes(nodes) -> int:
    return sum(1 for n in nodes if is_aten_node(n))


def log_captured(options, name: str, gm: torch.fx.GraphModule, seconds: float | None) -> None:
    """One line per captured ATen graph; ``seconds`` is the time from Dynamo's graph to
    this one (None for a backward graph, traced with its forward)."""
    if not options.progress:
        return
    nodes = aten_nodes(gm.graph.nodes)
    if seconds is None:
        logger.info("lort: %s: captured %d ATen nodes (traced with its forward)", name, nodes)
    else:
        logger.info("lort: %s: captured %d ATen nodes in %.2f s", name, nodes, seconds)


def stderr_is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed stream
        return False


def group_bar(options, name: str, total: int):
    """A tqdm bar over ``total`` groups, or None: the option is off, the graph has few
    groups, stderr is not a terminal, or tqdm is not installed (it is no dependency)."""
    if not options.progress or total < BAR_MIN_GROUPS or not stderr_is_terminal():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=f"lort {name}", unit="group", file=sys.stderr, leave=False)


class PrepareProgress:
    """The groups of one graph being translated and prepared: a bar while it lasts, and
    one line each for translation, session building and timing when it is done. Times
    add up every attempt (a graph re-fused after a failing node prepares again)."""

    def __init__(self, options, name: str):
        self.options, self.name = options, name
        self.times = {"translate": 0.0, "session": 0.0, "timing": 0.0}
        self.bar = None
        self._last = time.perf_counter()

    def start_round(self, total: int) -> None:
        self.close()
        self.bar = group_bar(self.options, self.name, total)
        self._last = time.perf_counter()

    def group_done(self, from_cache: bool, prepare_times: dict) -> None:
        """A group compiled (or failed to): ``prepare_times`` its seconds per step."""
        now = time.perf_counter()
        if from_cache:
            # Read from the disk cache: the time went to loading it and its session.
            self.times["session"] += now - self._last
        else:
            for step, seconds in prepare_times.items():
                self.times[step] = self.times.get(step, 0.0) + seconds
        self._last = now
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def log(self, groups, modules: dict) -> None:
        if not self.options.progress or self.options.mode == "pytorch" or not groups:
            return
        nodes = {g.name: aten_nodes(g.nodes) for g in groups}
        mods = {name: m for name, m in modules.items() if name in nodes}
        fresh = [name for name, m in mods.items() if not m.from_cache]
        cached = [name for name, m in mods.items() if m.from_cache]
        t, name = self.times, self.name
        if fresh:
            logger.info(
                "lort: %s: translated %d group(s) (%d ATen nodes) to ONNX in %.2f s%s",
                name, len(fresh), sum(nodes[n] for n in fresh), t["translate"],
                f"; {len(cached)} read from the disk cache" if cached else "",
            )
        elif cached:
            logger.info(
                "lort: %s: %d group(s) (%d ATen nodes) read from the disk cache, none translated",
                name, len(cached), sum(nodes[n] for n in cached),
            )
        built = [m for m in mods.values() if "session" in m.prepare_times or (m.from_cache and m.executor == Placement.ORT)]
        if built:
            logger.info("lort: %s: built %d ORT session(s) in %.2f s", name, len(built), t["session"])
        timed = [m for n, m in mods.items() if n in fresh and (m.thread_times or "pytorch" in m.executor_times)]
        if timed:
            what = [w for w, on in (
                ("ORT threads", any(m.thread_times for m in timed)),
                ("ORT against PyTorch", any("pytorch" in m.executor_times for m in timed)),
            ) if on]
            logger.info("lort: %s: timed %d group(s) (%s) in %.2f s", name, len(timed), ", ".join(what), t["timing"])
