"""DistributedDataParallel compiled by lort: a warning where Dynamo gives lort no graph.

``torch.compile(DDP(model), backend="lort")`` and ``DDP(torch.compile(model, ...))``
both train correctly; which of them hands lort graphs depends on where the model's
``forward`` is written (measured on torch 2.13, 2 gloo ranks):

- Dynamo traces ``DDP.forward`` and graph-breaks on its first line that touches the
  C++ reducer (``Logger.set_runtime_stats_and_log`` in ``_pre_forward``); the rest of
  DDP's forward runs eagerly, and ``_inside_ddp_forward`` is ``torch._disable_dynamo``
  on purpose (see the note above it in torch/nn/parallel/distributed.py). The wrapped
  module's ``forward`` is then compiled as a frame of its own, when Dynamo converts
  frames of that file: DDPOptimizer (``torch._dynamo.config.optimize_ddp``) splits its
  graph at DDP's bucket boundaries and each piece goes to lort.
- Dynamo never converts frames of files under ``torch/`` (``trace_rules``:
  "file matches MOD_SKIPLIST"). A model whose ``forward`` lives there (``nn.Sequential``,
  any ``torch.nn`` layer) is never compiled under ``torch.compile(DDP(model))``: lort
  (or any backend) gets no graph and everything runs eagerly. Nothing about gloo or the
  CPU is involved.

lort cannot see that case from its backend (it is never called), so importing the
backend wraps ``OptimizedModule.__init__``: when a DDP module whose wrapped model Dynamo
will skip is compiled with a lort backend, one warning says to compile the model inside
DDP. Other backends and other modules see no change.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import torch

from .autograd_function import is_lort_compiler

logger = logging.getLogger("lort")

_installed = False
_warned = False

# Not model.compile(): Module.compile of a module whose forward Dynamo skips gives no
# graph either (torch 2.13, with any backend).
_ADVICE = "compile the model inside DDP instead: DDP(torch.compile(model, backend='lort'))"


def skipped_root_reason(module: torch.nn.Module) -> str | None:
    """Why ``torch.compile(DDP(module))`` gives its backend no graph (Dynamo skips the
    frames of ``module``'s forward), or None when Dynamo compiles them."""
    from torch._dynamo import trace_rules
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None:
        return None  # compiled inside DDP already
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None:
        return None
    result = trace_rules.check_verbose(code)
    if not result.skipped:
        return None
    return f"Dynamo does not compile frames of {type(module).__module__}.{type(module).__qualname__}.forward ({result.reason})"


def check_compiled_module(module: torch.nn.Module, dynamo_ctx) -> None:
    """Warn once when a DDP module whose model Dynamo skips is compiled by lort."""
    global _warned
    if _warned or not torch.distributed.is_available():
        return
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(module, DistributedDataParallel):
        return
    if not is_lort_compiler(getattr(dynamo_ctx, "callback", None)):
        return
    reason = skipped_root_reason(module.module)
    if reason is None:
        return
    _warned = True
    warnings.warn(
        f"lort: torch.compile(DistributedDataParallel({type(module.module).__name__})) gives lort no "
        f"graph: {reason}, and DDP's own forward graph-breaks before calling it, so the model runs "
        f"eagerly in PyTorch. To run it through lort, {_ADVICE}.",
        UserWarning,
        stacklevel=_user_stacklevel(),
    )


def _user_stacklevel() -> int:
    """The stack level of the first frame outside torch and lort (the user's torch.compile)."""
    roots = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["lort"]))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(roots):
        frame, level = frame.f_back, level + 1
    return level


def install() -> bool:
    """Wrap OptimizedModule.__init__ (idempotent); False where torch lacks it."""
    global _installed
    if _installed:
        return True
    try:
        from torch._dynamo import trace_rules
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError as e:  # a torch whose Dynamo moved: no warning, nothing else changes
        logger.debug("lort: no DDP check on torch %s (%s)", torch.__version__, e)
        return False
    if not hasattr(trace_rules, "check_verbose"):
        logger.debug("lort: no DDP check on torch %s (trace_rules.check_verbose is missing)", torch.__version__)
        return False
    original = OptimizedModule.__init__

    def __init__(self, mod, dynamo_ctx, *args, **kwargs):
        original(self, mod, dynamo_ctx, *args, **kwargs)
        try:
            check_compiled_module(mod, dynamo_ctx)
        except Warning:
            raise  # warnings turned into errors by the user's filters
        except Exception as e:  # the check must never break torch.compile
            logger.debug("lort: DDP check failed: %s", e)

    __init__._lort_wrapped = True
    __init__.__wrapped__ = original
    OptimizedModule.__init__ = __init__
    _installed = True
    return True
