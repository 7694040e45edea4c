"""Output metadata of an opaque autograd.Function, found at capture time.

:func:`infer_outputs` runs the function's ``forward`` once (a plain ``FunctionCtx``, no
autograd, under :func:`~.state.capturing`): under fake tensors when it can, else on real
dummy tensors of the inputs' metadata. It fills the entry's output spec and metadata, which
outputs and are non-differentiable or dirty (modified inputs), and ``metadata_from``.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ...errors import OpaqueFunctionError
from .outputs import spec_of
from .registry import _Entry, _Slot, _TensorMeta
from .state import capturing

logger = logging.getLogger("lort")


def _run_forward_for_metadata(entry: _Entry, inputs: list[torch.Tensor]) -> None:
    """Runs ``forward`` with a plain FunctionCtx (no autograd) and records what it returns."""
    from torch.autograd.function import FunctionCtx, _is_setup_context_defined

    ctx = FunctionCtx()
    ctx.needs_input_grad = tuple(
        entry.needs_grad[a.index] if isinstance(a, _Slot) else False for a in entry.template
    )
    args = entry.args(inputs)
    with capturing(), torch.no_grad():
        if _is_setup_context_defined(entry.fn_cls.setup_context):
            result = entry.fn_cls.forward(*args)
            entry.fn_cls.setup_context(ctx, tuple(args), result)
        else:
            result = entry.fn_cls.forward(ctx, *args)
    tensors: list[torch.Tensor] = []
    entry.out_spec = spec_of(result, tensors)
    entry.out_meta = [_TensorMeta.of(t) for t in tensors]
    ids = {id(t): i for i, t in enumerate(tensors)}
    entry.non_differentiable = {ids[id(t)] for t in getattr(ctx, "non_differentiable", ()) if id(t) in ids}
    entry.dirty = {}
    for t in getattr(ctx, "dirty_tensors", ()):
        for j, x in enumerate(inputs):
            if t is x and id(t) in ids:
                entry.dirty[ids[id(t)]] = j


def _dummy(meta: _TensorMeta, gen: torch.Generator) -> torch.Tensor:
    shape = tuple(int(s) for s in meta.shape)
    stride = tuple(int(s) for s in meta.stride)
    t = torch.empty_strided(shape, stride, dtype=meta.dtype, device=meta.device)
    if meta.dtype.is_floating_point or meta.dtype.is_complex:
        t.copy_(torch.rand(shape, generator=gen, dtype=torch.float32).to(meta.dtype))
    elif meta.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(1)
    return t


def infer_outputs(entry: _Entry, fake_mode, fakes: list[torch.Tensor]) -> None:
    """Output metadata of ``entry``'s function: a fake-tensor run, else a dummy real run."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, is_concrete_int

    static = all(is_concrete_int(s) for f in fakes for s in (*f.shape, *f.stride()))
    try:
        # Static shapes: a fresh fake mode without a shape env, so .item() and the like
        # fail cleanly instead of adding unbacked symbols to Dynamo's shape env.
        mode = FakeTensorMode() if static else fake_mode
        shape_env = None if static else getattr(fake_mode, "shape_env", None)
        # ShapeEnv's method (torch 2.11 to 2.13; 2.13 also has a module-level context).
        ignore = contextlib.nullcontext() if shape_env is None else shape_env.ignore_fresh_unbacked_symbols()
        with mode, ignore:
            inputs = [torch.empty_strided(f.shape, f.stride(), dtype=f.dtype, device=f.device) for f in fakes]
            _run_forward_for_metadata(entry, inputs)
        if any(free_unbacked_symbols(m.shape) for m in entry.out_meta):
            raise OpaqueFunctionError("output shape depends on data")
        entry.metadata_from = "fake-tensor run"
        return
    except OpaqueFunctionError as e:
        if "output shape depends on data" not in str(e):
            raise
    except Exception as e:  # noqa: BLE001 - any failure under fake tensors: try real ones
        logger.debug("lort: %s does not run on fake tensors (%s); using a dummy run", entry.name, e)
    # Real tensors need concrete shapes: specialize symbolic sizes (a guard recompiles on change).
    from torch.fx.experimental.symbolic_shapes import guard_int

    metas = [
        _TensorMeta(
            tuple(guard_int(s) for s in f.shape), tuple(guard_int(s) for s in f.stride()), f.dtype, f.device
        )
        for f in fakes
    ]
    gen = torch.Generator().manual_seed(0)
    with unset_fake_temporarily():
        inputs = [_dummy(m, gen) for m in metas]
        try:
            _run_forward_for_metadata(entry, inputs)
        except Exception as e:  # noqa: BLE001
            raise OpaqueFunctionError(
                f"lort could not find the outputs of autograd.Function {entry.name}: its forward fails "
                f"on fake tensors and on dummy tensors at capture time ({type(e).__name__}: {e}). "
                f"Use lort.is_capturing() to skip what cannot run during capture."
            ) from e
    entry.metadata_from = "dummy run"
