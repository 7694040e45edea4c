"""Logging calls inside a module ORTModule captures: no-ops in its graph, as in torch.export.

ORTModule captures a module whole (``torch.compile(fullgraph=True)``), and Dynamo cannot
put a ``logging.Logger`` method call in a graph: such a call failed the capture and the
whole module ran in PyTorch. transformers' causal LMs make one in every forward with
labels (``logger.warning_once("`loss_type=None` was set in the config ...")``), so
``ORTModule(GPT2LMHeadModel(...))`` trained in PyTorch, with no ORT run. torch.export
makes such calls no-ops, and so does ORTModule's capture: while an entry is called (a
capture or a re-capture may happen inside the call), Dynamo's ``ignore_logging_functions``
also holds every logging method of ``logging.Logger``, the standard ones and any
``*_once`` a library added to the class (transformers' ``warning_once``, ``info_once``).
The calls do not run in the captured graph (onnxruntime-training's ORTModule ran them
once, while its exporter traced); ``torch.compile`` outside ORTModule is left as it is
(a graph break, as with any backend).
"""

from __future__ import annotations

import contextlib
import logging

import torch

_STANDARD = ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log")
#: (number of attributes of logging.Logger when computed, the methods): libraries add
#: their methods when imported, after lort.
_cached: tuple[int, frozenset] = (-1, frozenset())


def logger_methods() -> frozenset:
    """The logging methods of ``logging.Logger``: the standard ones and any ``*_once``."""
    global _cached
    attributes = vars(logging.Logger)
    if _cached[0] != len(attributes):
        names = set(_STANDARD) | {n for n in attributes if n.endswith("_once")}
        _cached = (len(attributes), frozenset(
            m for m in (getattr(logging.Logger, n, None) for n in names) if callable(m)))
    return _cached[1]


def _setting() -> str | None:
    """The name of Dynamo's setting of functions to ignore (renamed in torch 2.13; the old
    name is an alias there)."""
    config = torch._dynamo.config
    for name in ("ignore_logging_functions", "ignore_logger_methods"):
        if hasattr(config, name):
            return name
    return None


@contextlib.contextmanager
def ignored():
    """Within the block, Dynamo traces a ``logging.Logger`` method call as a no-op."""
    name = _setting()
    if name is None:
        yield
        return
    config = torch._dynamo.config
    saved = getattr(config, name)
    setattr(config, name, set(saved) | logger_methods())
    try:
        yield
    finally:
        setattr(config, name, saved)
