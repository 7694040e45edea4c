"""The custom ops of opaque autograd.Function calls and their autograd (PythonOp/PythonOpGrad).

* ``lort::python_op(handle, tensors) -> [outputs..., token]``: its kernel calls
  ``Function.apply`` on the real tensors with autograd on (inputs that need grad are
  detached leaves), so the function's ctx is PyTorch's own: ``save_for_backward``,
  ``needs_input_grad``, ``mark_dirty``, ``mark_non_differentiable``,
  ``set_materialize_grads`` and attributes behave as in eager. The last output is the ctx
  token (``registry.py``), or ``[-1]`` when nothing needs a gradient.
* ``lort::python_op_backward(handle, token, grads) -> [grads of inputs]`` runs
  ``torch.autograd.grad`` through that ctx, i.e. the function's own backward.

Inside a custom op kernel the autograd dispatch keys are excluded; :func:`_autograd_on`
puts them back through the dispatch-key TLS (``REQUIRED_C_NAMES``, checked by
``dynamo_patch.check_torch_internals``). Importing this module registers the ops.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from ...errors import OpaqueFunctionError
from .outputs import tensors_of
from .registry import _lookup, _new_token, _token_state

#: torch._C internals :func:`_autograd_on` uses.
REQUIRED_C_NAMES = ("_ForceDispatchKeyGuard", "_dispatch_tls_local_exclude_set", "_dispatch_tls_local_include_set")

_AUTOGRAD_KEYS = (
    torch._C.DispatchKey.AutogradFunctionality,
    torch._C.DispatchKey.AutogradOther,
    torch._C.DispatchKey.AutogradNestedTensor,
    torch._C.DispatchKey.ADInplaceOrView,
)


@contextlib.contextmanager
def _autograd_on(grad: bool) -> Iterator[None]:
    """Inside a custom op kernel the autograd keys are excluded; put them back, as
    eager PyTorch would have them around ``Function.apply``."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        with torch.set_grad_enabled(grad):
            yield


# -- the ops ------------------------------------------------------------------------------


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1


@torch.library.custom_op("lort::python_op", mutates_args=())
def _python_op(handle: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    entry = _lookup(handle)
    want_grad = any(entry.needs_grad)
    dirty_inputs = set(entry.dirty.values())
    leaves: list[torch.Tensor] = []
    with _autograd_on(want_grad):
        ins = []
        for i, t in enumerate(tensors):
            if want_grad and entry.needs_grad[i]:
                # A graph input that requires grad (a parameter, the caller's tensor) is
                # passed as itself: code that also reaches it another way (a checkpointed
                # module's parameters) then sees the same tensor, as in eager. Others
                # become detached leaves.
                leaf = t if (t.requires_grad and t.is_leaf) else t.detach().requires_grad_(True)
                leaves.append(leaf)
                # A function that modifies its input in place gets a non-leaf copy (the
                # graph copies the result back into the caller's tensor).
                ins.append(leaf.clone() if i in dirty_inputs else leaf)
            else:
                ins.append(t.clone() if i in dirty_inputs else t)
        result = entry.fn_cls.apply(*entry.args(ins))
    outs = tensors_of(entry, result)
    in_ptrs = {_storage_ptr(t) for t in tensors}
    seen: set[int] = set()
    ret = []
    for o in outs:
        d = o.detach()
        ptr = _storage_ptr(d)
        if ptr in in_ptrs or ptr in seen:  # a custom op's outputs may not alias
            d = d.clone()
        seen.add(_storage_ptr(d))
        ret.append(d)
    if want_grad and any(o.requires_grad for o in outs):
        ret.append(_new_token((entry, outs, leaves)))
    else:
        ret.append(torch.full((1,), -1, dtype=torch.int64))
    return ret


@_python_op.register_fake
def _python_op_fake(handle: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    entry = _lookup(handle)
    return [m.empty() for m in entry.out_meta] + [torch.empty(1, dtype=torch.int64, device="cpu")]


@torch.library.custom_op("lort::python_op_backward", mutates_args=())
def _python_op_backward(
    handle: int, token: torch.Tensor, grads: list[Optional[torch.Tensor]]
) -> list[torch.Tensor]:
    entry = _lookup(handle)
    state = _token_state(token)
    if state is None:
        raise OpaqueFunctionError(
            f"lort: the saved context of autograd.Function {entry.name} is gone; its backward "
            f"can run once per forward (use retain_graph=True to run it again)"
        )
    _, outs, leaves = state
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    with _autograd_on(True):
        if pairs:
            res = torch.autograd.grad(
                [o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True
            )
        else:
            res = (None,) * len(leaves)
    taken = {_storage_ptr(t) for t in (token, *grads) if t is not None}
    out = []
    for r, leaf in zip(res, leaves):
        if r is None:
            r = torch.zeros_like(leaf, memory_format=torch.contiguous_format)
        elif _storage_ptr(r) in taken:  # a custom op's outputs may not alias
            r = r.clone()
        taken.add(_storage_ptr(r))
        out.append(r)
    return out


@_python_op_backward.register_fake
def _python_op_backward_fake(handle: int, token: torch.Tensor, grads: list[Optional[torch.Tensor]]):
    entry = _lookup(handle)
    return [
        torch.empty(m.shape, dtype=m.dtype, device=m.device)
        for m, need in zip(entry.in_meta, entry.needs_grad)
        if need
    ]


def _setup_context(ctx, inputs, output) -> None:
    # Unused outputs' gradients stay None: the user's ctx decides (set_materialize_grads).
    ctx.set_materialize_grads(False)
    ctx.handle = inputs[0]
    ctx.n_inputs = len(inputs[1])
    ctx.save_for_backward(output[-1])


def _backward(ctx, grads):
    (token,) = ctx.saved_tensors
    entry = _lookup(ctx.handle)
    got = torch.ops.lort.python_op_backward(ctx.handle, token, list(grads[:-1]))
    full: list[Optional[torch.Tensor]] = [None] * ctx.n_inputs
    it = iter(got)
    for i, need in enumerate(entry.needs_grad):
        if need:
            full[i] = next(it)
    return None, full


_python_op.register_autograd(_backward, setup_context=_setup_context)
# python_op is NOT marked side-effectful: AOTAutograd's partitioner would then copy it,
# dead, into the backward graph too and the forward would run twice. The price: a call
# whose outputs are all unused is dropped (documented in the README).
