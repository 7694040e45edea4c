"""``lort.explain``: capture and fuse a call, and report what runs where and why."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from .report import ExplainReport


def explain(fn: Callable, *args: Any, **kwargs: Any) -> ExplainReport:
    """Compile ``fn`` with lort, call it on ``args``/``kwargs`` and, when an output
    requires grad, run its backward too (with torch.autograd.grad, so no ``.grad`` is
    touched). Returns the report of every captured graph: ``graphs``, ``groups``,
    ``ort_nodes``, ``torch_nodes`` and ``fallbacks`` as (op, reason) pairs."""
    from ..backend import LortBackend

    # ORT's own fusions show in the report: each group's session is built a second time
    # to read the graph ORT optimized.
    backend = LortBackend({"record_ort_graph": True})
    compiled = torch.compile(fn, backend=backend)
    out = compiled(*args, **kwargs)
    outs = [
        t
        for t in pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.dtype.is_floating_point
    ]
    if outs:
        leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        if isinstance(fn, torch.nn.Module):
            leaves += [p for p in fn.parameters() if p.requires_grad]
        if leaves:
            total = sum(o.float().sum() for o in outs)
            torch.autograd.grad(total, leaves, allow_unused=True)
    return ExplainReport(backend.records)
