"""ORT sessions for fusion groups and zero-copy execution with IOBinding."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
import torch

from ..errors import SessionCreationError
from ..options import Options
from . import providers

logger = logging.getLogger("lort")

_NP_DTYPES = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}

_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


class _Stats:
    """Counters a test or benchmark can read: sessions built, ORT runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sessions_created = 0
        self.ort_runs = 0

    def add_session(self) -> None:
        with self._lock:
            self.sessions_created += 1


stats = _Stats()


def session_options(options: Options) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = _LEVELS[options.graph_optimization_level]
    so.intra_op_num_threads = options.intra_op_num_threads or torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    spin = "1" if options.allow_spinning else "0"
    so.add_session_config_entry("session.intra_op.allow_spinning", spin)
    so.add_session_config_entry("session.inter_op.allow_spinning", spin)
    return so


@dataclass
class OutputSpec:
    dtype: torch.dtype
    shape: tuple[int, ...] | None  # None when symbolic: ORT allocates


def _ort_device(device: torch.device) -> tuple[str, int]:
    if device.type == "cuda":
        return "cuda", device.index if device.index is not None else torch.cuda.current_device()
    return "cpu", 0


class GroupSession:
    """One ORT session of one group for one argument spec."""

    def __init__(self, model_bytes: bytes, device: torch.device, outputs: list[OutputSpec], options: Options, name: str):
        self.name = name
        self.device = device
        self.outputs = outputs
        try:
            self.session = ort.InferenceSession(
                model_bytes,
                sess_options=session_options(options),
                providers=providers.for_device(device, options.providers),
            )
        except Exception as e:
            raise SessionCreationError(f"ONNX Runtime could not build a session for group {name!r}: {e}") from e
        stats.add_session()
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._ort_device = _ort_device(device)
        self._run_options = ort.RunOptions()

    def run(self, args: list) -> list[torch.Tensor]:
        """Run on torch tensors (and Python int/float scalars), sharing memory with ORT."""
        binding = self.session.io_binding()
        dev_type, dev_id = self._ort_device
        keep = []  # tensors whose memory ORT reads must outlive the run
        for name, a in zip(self.input_names, args):
            if isinstance(a, torch.Tensor):
                t = a.detach()
                if not t.is_contiguous():
                    t = t.contiguous()
            else:
                t = torch.tensor(a, dtype=torch.int64 if isinstance(a, int) else torch.float32, device=self.device)
            if t.numel() == 0:
                t = torch.empty(1, dtype=t.dtype, device=t.device)[:0].reshape(t.shape)
            keep.append(t)
            binding.bind_input(name, dev_type, dev_id, _NP_DTYPES[t.dtype], tuple(t.shape), t.data_ptr())
        results: list[torch.Tensor | None] = []
        for name, spec in zip(self.output_names, self.outputs):
            if spec.shape is not None and all(d > 0 for d in spec.shape):
                out = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
                binding.bind_output(name, dev_type, dev_id, _NP_DTYPES[spec.dtype], spec.shape, out.data_ptr())
                results.append(out)
            else:
                binding.bind_output(name, dev_type, dev_id)
                results.append(None)
        self.session.run_with_iobinding(binding, self._run_options)
        stats.ort_runs += 1
        if any(r is None for r in results):
            ort_values = binding.get_outputs()
            for i, r in enumerate(results):
                if r is None:
                    results[i] = _from_ortvalue(ort_values[i], self.outputs[i].dtype, self.device)
        del keep
        return results  # type: ignore[return-value]


def _from_ortvalue(value, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.from_numpy(value.numpy()).to(dtype)
    return torch.from_dlpack(value.to_dlpack()) if hasattr(value, "to_dlpack") else torch.from_numpy(value.numpy()).to(device)
