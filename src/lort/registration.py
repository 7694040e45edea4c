"""The torch.compile name ``onnxrt``, served by lort where torch has none of its own.

PyTorch's own ONNX Runtime backend (DORT), ``torch.compile(backend="onnxrt")``, is gone
from torch 2.13, but the name lives on in code and in tools' fixed lists: accelerate's
``DynamoBackend`` (so ``TrainingArguments(torch_compile_backend=...)`` and
``Accelerator(dynamo_backend=...)``) accepts ``onnxrt`` and refuses ``lort``.

lort registers ``onnxrt`` by the same ``torch_dynamo_backends`` entry point as ``lort``
(pyproject.toml). Dynamo resolves a name to a backend registered by torch itself before
an entry point (``lookup_backend`` in torch/_dynamo/backends/registry.py loads an entry
point only for a name not in ``_COMPILER_FNS``), so a torch that still has its own
``onnxrt`` keeps it; on torch 2.13 the name runs lort, the same backend as ``lort``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import torch

from .backend import lort_backend, options_for_mode
from .capture.autograd_function import BACKEND_MARKER

logger = logging.getLogger("lort")

_announce_lock = threading.Lock()
_announced = False


def onnxrt_backend(gm: torch.fx.GraphModule, example_inputs: list, options: Any = None,
                   mode: str | None = None) -> Callable:
    """``torch.compile(model, backend="onnxrt")`` where torch has no ``onnxrt``: lort.

    ``options`` are lort's (a dict or ``lort.Options``); with none, lort's options come
    from the ``LORT_*`` environment variables, which is how options reach lort from
    Trainer and accelerate. ``mode`` is taken as ``backend="lort"`` takes it: lort's run
    modes, or torch.compile's own (inductor's, accepted and ignored).
    """
    options = options_for_mode(mode, options, "onnxrt")
    _announce()
    return lort_backend(gm, example_inputs, options)


setattr(onnxrt_backend, BACKEND_MARKER, True)


def _announce() -> None:
    global _announced
    with _announce_lock:
        if _announced:
            return
        _announced = True
    logger.info(
        "lort: torch.compile backend 'onnxrt' is served by lort (torch %s has no onnxrt backend of "
        "its own); lort's options come from options={...} or the LORT_* environment variables",
        torch.__version__,
    )
