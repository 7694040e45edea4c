"""The timed choices of one group, a mixin of ``GroupCompiler`` (group_compiler.py):
its ORT thread count, ORT or PyTorch under executor="auto", and the CPU inference
groups whose products alone make a run long, left to their graph's timing over its
calls with no run at compile time (Tuner.surely_long, Tuner.left_to_graph)."""

from __future__ import annotations

import logging

import torch

from ..reasons import Placement
from ..runtime.session import GroupSession
from .flops import product_flops

logger = logging.getLogger("lort")


class GroupChoices:
    """What ``GroupCompiler`` times, with its ``options`` and ``tuner``."""

    def _max_threads(self) -> int:
        return self.options.intra_op_num_threads or torch.get_num_threads()

    def _surely_long(self, name: str, gm: torch.fx.GraphModule, device: torch.device, dynamic: bool,
                     inference: bool) -> float | None:
        """The least seconds a run of a CPU inference group takes, where its products
        alone make it longer than Tuner.graph_budget_s at the core's peak speed: such a
        group runs on every thread and in ORT, and its graph is timed against eager
        PyTorch over its calls. None for any other group (timed here as before)."""
        if not inference or dynamic or device.type != "cpu":
            return None
        least = self.tuner.surely_long(product_flops(gm), self._max_threads())
        if least is not None:
            logger.info("lort: %s: its products take at least %.2f s a run: every thread, not timed at compile time",
                        name, least)
        return least

    def _choose_threads(self, model_bytes, device, feeds, dynamic, sess: GroupSession) -> tuple[int, dict]:
        """``sess``: the group's session with every thread, timed for that count."""
        threads = self._max_threads()
        if self.options.intra_op_num_threads is not None or threads == 1 or dynamic or device.type != "cpu":
            return threads, {}
        return self.tuner.choose_threads(model_bytes, device, self.options, feeds, threads, built=sess.session)

    def _choose_executor(self, name, gm, b, sess, feeds, ort_feeds, model_bytes, threads, thread_times,
                         inference: bool):
        """Time the group in PyTorch against its ORT time; keep the faster. On CUDA
        both are timed on device tensors, synchronized around the timed region. A long
        CPU inference group stays in ORT untimed against PyTorch (Tuner.left_to_graph)."""
        device = sess.device
        if device.type not in ("cpu", "cuda"):
            return Placement.ORT, {}
        if device.type == "cuda":
            ort_time = self.tuner.time_group_session(sess, ort_feeds, device)
        else:
            ort_time = min((t for t in thread_times.values() if t is not None), default=None)
            if ort_time is None:
                ort_time = self.tuner.time_session(model_bytes, device, self.options, threads, ort_feeds)
            if inference and self.tuner.left_to_graph(ort_time):  # found long by its run
                logger.info("lort: %s: a run takes %.2f s in ORT: not timed in PyTorch here; its graph is timed "
                            "against eager PyTorch over its calls", name, ort_time)
                return Placement.ORT, {"ort": ort_time}
        torch_time = self.tuner.time_pytorch(gm, feeds, list(b.in_perms), device)
        if ort_time is None or torch_time is None:
            return Placement.ORT, {}

        def again():
            return {"ort": self.tuner.time_group_session(sess, ort_feeds, device) if device.type == "cuda"
                    else self.tuner.time_session(model_bytes, device, self.options, threads, ort_feeds),
                    "pytorch": self.tuner.time_pytorch(gm, feeds, list(b.in_perms), device)}

        both = self.tuner.timed_again_if_close({"ort": ort_time, "pytorch": torch_time}, again)
        ort_time, torch_time = both["ort"], both["pytorch"]
        executor = self.tuner.choose_group_executor(ort_time, torch_time)
        if executor == Placement.PYTORCH:
            logger.info("lort: %s runs in PyTorch: %.0f us there vs %.0f us in ORT", name, torch_time * 1e6, ort_time * 1e6)
        return executor, {"ort": ort_time, "pytorch": torch_time}
