"""lort: run PyTorch models, training and inference, through ONNX Runtime.

    cm = torch.compile(model, backend="lort")
    cm = torch.compile(model, backend="lort", options={"mode": "debug", "rtol": 1e-4})
    print(lort.explain(model, x))
"""

from __future__ import annotations

import logging

from ._version import __version__

from .backend import LortBackend, lort_backend
from .capture.autograd_function import is_capturing
from .diagnostics.explain import explain
from .diagnostics.report import ExplainReport
from .errors import (
    CaptureError,
    LortError,
    MismatchError,
    OpaqueFunctionError,
    QuantizationError,
    SessionCreationError,
    SessionRunError,
    TranslationError,
    UnsupportedInputError,
    UnsupportedVersionError,
)
from .module import DebugOptions, LogLevel, ORTModule
from .options import Options
from .runtime import stats

logging.getLogger("lort").addHandler(logging.NullHandler())

__all__ = [
    "CaptureError",
    "DebugOptions",
    "LogLevel",
    "ORTModule",
    "ExplainReport",
    "LortBackend",
    "LortError",
    "MismatchError",
    "OpaqueFunctionError",
    "Options",
    "QuantizationError",
    "SessionCreationError",
    "SessionRunError",
    "TranslationError",
    "UnsupportedInputError",
    "UnsupportedVersionError",
    "explain",
    "is_capturing",
    "lort_backend",
    "stats",
]
