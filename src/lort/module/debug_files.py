"""The files ``DebugOptions(save_onnx=True, onnx_prefix=P)`` writes: per group, lort's
own (``P_train_s1_g1_forward_0.onnx``, by train/eval, schema entry, graph kind and
group), and under onnxruntime-training ORTModule's names, each holding the ORT groups of
the captured graph side by side (translate/side_by_side.py; lort runs no whole-model
ONNX graph), rewritten by the latest capture as ORTModule's are:

- ``P_torch_exported_{training,inference}.onnx``: the plain translations (torch_lib's,
  before onnxscript's rewrites) of the forward or inference graph's groups;
- ``P_optimized_pre_grad_training.onnx``: the forward groups as they run (rewritten);
- ``P_optimized_{training,inference}.onnx``: the groups as they run, forward and
  backward for training;
- ``P_execution_model_{training,inference}.onnx``: ORT's optimized graph of the latter
  (what its sessions execute).

Frozen weights appear as inputs (lort freezes them when it builds a session).
"""

from __future__ import annotations

import logging
import os

import onnx
import torch

from ..backend import LortBackend
from ..options import Options
from ..reasons import Placement
from ..runtime.session import save_optimized
from ..translate.side_by_side import side_by_side

logger = logging.getLogger("lort")


class ModuleBackend(LortBackend):
    """LortBackend of one ORTModule schema entry; with ``save`` (directory, file stem,
    onnx_prefix) it writes the files above after each graph it compiles."""

    def __init__(self, options: Options, save: tuple[str, str, str] | None):
        super().__init__(options)
        self._save = save
        self._forward: list[bytes] = []  # the forward's running models, for the backward's files

    def compile_graph(self, gm, example_inputs, kind, captured_s=None, weights=None):
        fn, record = super().compile_graph(gm, example_inputs, kind, captured_s, weights)
        if self._save is not None:
            self._write(record, kind)
        return fn, record

    def _write(self, record, kind: str) -> None:
        directory, stem, prefix = self._save
        os.makedirs(directory, exist_ok=True)
        plain, running = [], []
        for name, mod in record.group_modules.items():
            if mod.model_bytes is None:
                continue
            self._write_file(os.path.join(directory, f"{stem}_{name}.onnx"), mod.model_bytes)
            if mod.executor == Placement.ORT:
                running.append(mod.model_bytes)
                plain.append(mod.compiled.plain_bytes or mod.model_bytes)
        mode = "inference" if kind == "inference" else "training"
        base = os.path.join(directory, prefix)
        if kind in ("forward", "inference"):
            self._write_file(f"{base}_torch_exported_{mode}.onnx", side_by_side(plain, f"{prefix}_torch_exported"))
        if kind == "forward":
            self._forward = running
            self._write_file(f"{base}_optimized_pre_grad_training.onnx", side_by_side(running, f"{prefix}_pre_grad"))
            return
        if kind == "backward":
            running = self._forward + running
        optimized = side_by_side(running, f"{prefix}_optimized").SerializeToString()
        self._write_file(f"{base}_optimized_{mode}.onnx", optimized)
        path = f"{base}_execution_model_{mode}.onnx"
        try:
            save_optimized(optimized, path, torch.device("cpu"), self.options, None)
            logger.info("lort.ORTModule: wrote %s", path)
        except Exception as e:  # noqa: BLE001 - a debug file: never fails the compile
            logger.warning("lort.ORTModule: could not write %s: %s", path, e)

    @staticmethod
    def _write_file(path: str, model) -> None:
        data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
        with open(path, "wb") as f:
            f.write(data)
        logger.info("lort.ORTModule: wrote %s", path)
