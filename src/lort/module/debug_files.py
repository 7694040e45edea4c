"""The files ``DebugOptions(save_onnx=True, onnx_prefix=P)`` writes: per group, lort's
own (``P_train_s1_g1_forward_0.onnx``, by train/eval, schema entry, graph kind and
group), and under onnxruntime-training ORTModule's names, each holding the ORT groups of
the captured graph side by side (translate/side_by_side.py; lort runs no whole-model
ONNX graph), rewritten by the latest capture as ORTModule's are. Their suffix is the
module's mode, as onnxruntime-training names them: ``training`` in train mode with grad
enabled, ``inference`` otherwise (eval mode, or no grad):

- ``P_torch_exported_{training,inference}.onnx``: the plain translations (torch_lib's,
  before onnxscript's rewrites) of the forward or inference graph's groups;
- ``P_optimized_pre_grad_training.onnx``: the forward groups as they run (rewritten);
- ``P_optimized_{training,inference}.onnx``: the groups as they run, forward and
  backward (a backward also in eval mode, where grad is enabled);
- ``P_execution_model_{training,inference}.onnx``: ORT's optimized graph of the latter
  (what its sessions execute).

A graph lort runs in eager PyTorch by its own choice (under its cheapest call, or by a
choice in the disk cache) is translated for these files alone (backend.py,
``_save_files_of_eager_graph``): the files are written, or a warning names them.
Frozen weights appear as inputs (lort freezes them when it builds a session).
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import onnx
import torch

from ..backend import LortBackend
from ..options import Options
from ..reasons import Placement
from ..runtime.session import save_optimized
from ..translate.side_by_side import side_by_side

logger = logging.getLogger("lort")


class Save(NamedTuple):
    """Where and under which names an ORTModule schema entry writes its files."""

    directory: str
    stem: str  # lort's own names: P_{train|eval}_s{schema}
    prefix: str  # onnxruntime-training's names: P_..._{names}.onnx
    names: str  # "training" or "inference": the module's mode, as onnxruntime-training says it


class ModuleBackend(LortBackend):
    """LortBackend of one ORTModule schema entry; with ``save`` it writes the files above
    after each graph it compiles. ``first_graph``: the number of graphs an earlier
    backend of the same entry compiled (its files' numbers go on from there)."""

    def __init__(self, options: Options, save: Save | None, first_graph: int = 0):
        super().__init__(options)
        self.save = save
        self._count = first_graph
        self._forward: list[bytes] = []  # the forward's running models, for the backward's files

    @property
    def graph_number(self) -> int:
        """How many graphs this backend numbered (compiled, or placed in eager PyTorch)."""
        return self._count

    def compile_graph(self, gm, example_inputs, kind, captured_s=None, weights=None):
        fn, record = super().compile_graph(gm, example_inputs, kind, captured_s, weights)
        if self.save is not None:
            self._write(record, kind)
        return fn, record

    def _saves_files(self) -> bool:
        return self.save is not None or super()._saves_files()

    def _files_backend(self, options: Options) -> "ModuleBackend":
        return ModuleBackend(options, self.save)

    def _files_wanted(self) -> str:
        if self.save is None:
            return super()._files_wanted()
        return f"{self.save.prefix}_*_{self.save.names}.onnx and {self.save.stem}_g*.onnx in {self.save.directory}"

    def _write(self, record, kind: str) -> None:
        directory, stem, prefix, mode = self.save
        os.makedirs(directory, exist_ok=True)
        plain, running = [], []
        for name, mod in record.group_modules.items():
            if mod.model_bytes is None:
                continue
            self._write_file(os.path.join(directory, f"{stem}_{name}.onnx"), mod.model_bytes)
            if mod.executor == Placement.ORT:
                running.append(mod.model_bytes)
                plain.append(mod.compiled.plain_bytes or mod.model_bytes)
        base = os.path.join(directory, prefix)
        if kind in ("forward", "inference"):
            self._forward = running
            self._write_file(f"{base}_torch_exported_{mode}.onnx", side_by_side(plain, f"{prefix}_torch_exported"))
            if mode == "training":
                self._write_file(f"{base}_optimized_pre_grad_training.onnx",
                                 side_by_side(running, f"{prefix}_pre_grad"))
                if kind == "forward":
                    return  # optimized_training holds the backward too: written with it
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
