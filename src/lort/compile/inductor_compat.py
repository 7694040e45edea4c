"""Inductor's compile of a Dynamo graph, with its code generation in a subprocess: the
one place lort touches inductor's internals (torch 2.13's ``torch._inductor``).

``torch.compile``'s own background mode (``TORCHINDUCTOR_FX_COMPILE_MODE=async+subprocess``)
compiles each graph in the process first, to run something while the subprocess works,
which is the cost lort avoids. So ``start`` runs inductor's front half here, on the
caller's thread (AOTAutograd's trace of the forward and backward, seconds on a
transformer; FX tracing patches ``torch.nn.Module.__call__`` for the whole process, so it
cannot run on another thread while the model runs), and sends each graph's code
generation and C++ compile to inductor's compile subprocess (``_SubprocessFxCompile``,
the one worker inductor keeps per process), returning at once. The callable it returns
is valid once ``ready()``; a failure in the subprocess is raised by ``result()``.

Inductor's FX graph cache is off for these compiles: a pending graph cannot be saved. So
is its layout optimization where the graph trains (below, where it is turned off).
Inductor's graph pickler sends only ``aten`` (and ``fbgemm``) ops to its subprocess and
refuses any other (``torch.ops.prims.convert_element_type``, in every graph with a dtype
cast after inductor's decompositions: BERT's attention mask); ``prims`` ops are built
into torch like ``aten``'s and resolve by name in the subprocess, so they are let
through while lort compiles.
Where these internals are missing (another torch), ``start`` raises ``InductorUnavailable``
with the reason, and lort leaves inductor out of its choices.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from .tuner import trains


class InductorUnavailable(RuntimeError):
    """Inductor's background compile cannot run with this torch (or for this graph)."""


def _internals():
    try:
        import torch._inductor.compile_fx as compile_fx
        from torch._inductor.compile_fx_subproc import _SubprocessFxCompile
        from torch._inductor.output_code import OutputCode
    except ImportError as e:
        raise InductorUnavailable(f"this torch's inductor has no subprocess compile ({e})") from None
    missing = [name for obj, name in ((compile_fx, "fx_codegen_and_compile"), (compile_fx, "compile_fx"),
                                      (_SubprocessFxCompile, "serialize_compile"),
                                      (_SubprocessFxCompile, "_send_to_child_async"),
                                      (_SubprocessFxCompile, "_postprocess"))
               if not hasattr(obj, name)]
    if missing:
        raise InductorUnavailable(f"this torch's inductor lacks {', '.join(missing)} (lort knows torch 2.13's)")
    return compile_fx, _SubprocessFxCompile, OutputCode


class BackgroundCompile:
    """Inductor's compile of one Dynamo graph: ``fn`` runs it once ``ready()``."""

    def __init__(self):
        self.fn: Callable | None = None
        self._pending: list = []

    def ready(self) -> bool:
        return all(p.done() for p in self._pending)

    def result(self) -> Callable:
        """The compiled callable; raises the subprocess's error where it failed."""
        for p in self._pending:
            p.resolve()
        return self.fn


def start(gm: torch.fx.GraphModule, example_inputs: list) -> BackgroundCompile:
    """Trace ``gm`` as inductor does and start its code generation in the subprocess
    (module docstring). ``gm`` is left as it is (inductor's passes run on a copy)."""
    compile_fx, subprocess_compile, output_code = _internals()
    job = BackgroundCompile()

    class Pending(output_code):
        """One graph's compile in the subprocess, as inductor's OutputCode."""

        def __init__(self, sub, future, constants):
            # An instance attribute: AOTAutograd wraps a backward with functools.wraps,
            # which copies the instance's __dict__, not class attributes.
            self._boxed_call = True
            self._sub, self._future, self._constants = sub, future, constants
            self._code = None
            self._post: tuple | None = None

        def done(self) -> bool:
            return self._code is not None or self._future.done()

        def resolve(self) -> None:
            if self._code is not None:
                return
            out = self._future.result().deserialize(self._constants)
            self._sub._postprocess(out)
            code = out.graph
            if self._post is not None:
                code.post_compile(*self._post)
            self._code, self._future, self._constants = code, None, None

        def __call__(self, inputs: Any) -> Any:
            self.resolve()
            return self._code(inputs)

        def post_compile(self, example_inputs, constants, graph_kwargs) -> None:
            self._post = (example_inputs, constants, graph_kwargs)

        def prepare_for_serialization(self) -> None:
            pass

        def set_triton_bundle(self, triton_bundle) -> None:
            pass

    def codegen(gm, example_inputs, inputs_to_check, compile_region_name=None, **graph_kwargs):
        sub = subprocess_compile()
        serialized = sub.serialize_compile(gm, example_inputs, inputs_to_check, graph_kwargs)
        if not serialized:
            raise InductorUnavailable("inductor cannot send this graph to its subprocess")
        inputs, constants = serialized
        pending = Pending(sub, sub._send_to_child_async(inputs), constants)
        job._pending.append(pending)
        return pending

    copy = torch.fx.GraphModule(gm, _copy_graph(gm.graph))
    real = compile_fx.fx_codegen_and_compile
    compile_fx.fx_codegen_and_compile = codegen
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_prims_picklable())
            # The backward is compiled now too (AOTAutograd compiles it at its first run).
            stack.enter_context(torch._functorch.config.patch(force_non_lazy_backward_lowering=True))
            # Inductor's layout optimization (channels-last around convolutions) changes the
            # forward's saved tensors' strides at code generation; its backward learns them
            # from the compiled forward, which is still in the subprocess when the backward
            # is sent: it then expected dense strides and failed on the forward's
            # channels-last ones (every convolutional model: ResNet-50, ViT's patch embedding).
            # A graph without a backward keeps it, as torch.compile's inductor has it
            # (ResNet-50 inference, batch 8, on 2 cores: this compile's code 387 against
            # 454 ms without it).
            layout = not trains(example_inputs)
            stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False, layout_optimization=layout))
            job.fn = torch._dynamo.disable(compile_fx.compile_fx)(copy, list(example_inputs))
    finally:
        compile_fx.fx_codegen_and_compile = real
    return job


@contextlib.contextmanager
def _prims_picklable():
    """Inductor's graph pickler also takes ``torch.ops.prims`` ops (module docstring)."""
    try:
        from torch.fx import _graph_pickler as pickler
    except ImportError:
        yield
        return
    safe = getattr(pickler, "_ops_filter_safe", None)
    defaults = getattr(pickler.Options.__init__, "__defaults__", None) or ()
    if safe is None or safe not in defaults:
        yield
        return

    def prims_too(name: str) -> bool:
        return safe(name) or name.startswith("torch.ops.prims.")

    pickler.Options.__init__.__defaults__ = tuple(prims_too if d is safe else d for d in defaults)
    try:
        yield
    finally:
        pickler.Options.__init__.__defaults__ = defaults


#: Node metadata that names the model's classes (a module stack): pickled for the
#: subprocess, it would import the model's library there (transformers, and through it
#: torchvision, which may not import beside this torch). Inductor only names kernels
#: after it.
_MODULE_META = ("nn_module_stack", "fwd_nn_module_stack", "source_fn_stack", "fwd_source_fn_stack")


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    import copy

    new = copy.deepcopy(graph)
    for node in new.nodes:
        for key in _MODULE_META:
            node.meta.pop(key, None)
    return new
