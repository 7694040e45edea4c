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

Inductor's FX graph cache is off for these compiles: a pending graph cannot be saved.
Its layout optimization stays on (channels-last around convolutions), as torch.compile
has it. Where the graph trains, that changes the strides of the tensors the forward
saves, at the forward's code generation, and AOTAutograd hands the backward the strides
the forward's compiled code reports: here that code is still in the subprocess when the
backward is traced. So the backward is held, pickled only once the forward's code has
come back, with its saved tensors restrided as that code makes them (``_Backward``); the
subprocess compiles one graph at a time, so the wait costs nothing but the interval until
the next call polls.
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
import types
from typing import Any, Callable

import torch


class InductorUnavailable(RuntimeError):
    """Inductor's background compile cannot run with this torch (or for this graph)."""


def _internals():
    try:
        import torch._inductor.compile_fx as compile_fx
        from torch._inductor.compile_fx_ext import _WireProtocolInput
        from torch._inductor.compile_fx_subproc import _SubprocessFxCompile
        from torch._inductor.output_code import OutputCode
    except ImportError as e:
        raise InductorUnavailable(f"this torch's inductor has no subprocess compile ({e})") from None
    missing = [name for obj, name in ((compile_fx, "fx_codegen_and_compile"), (compile_fx, "compile_fx"),
                                      (_SubprocessFxCompile, "serialize_compile"),
                                      (_SubprocessFxCompile, "_send_to_child_async"),
                                      (_SubprocessFxCompile, "_postprocess"),
                                      (_WireProtocolInput, "serialize"))
               if not hasattr(obj, name)]
    if missing:
        raise InductorUnavailable(f"this torch's inductor lacks {', '.join(missing)} (lort knows torch 2.13's)")
    return compile_fx, _SubprocessFxCompile, OutputCode, _WireProtocolInput


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
    compile_fx, subprocess_compile, output_code, wire_input = _internals()
    job = BackgroundCompile()
    forward: dict = {}  # the last forward sent: its Pending and its outputs' node names

    class Pending(output_code):
        """One graph's compile in the subprocess, as inductor's OutputCode; a backward
        held until its forward's code is back (``backward``: a ``_Backward``)."""

        def __init__(self, sub, future, constants, backward: _Backward | None = None):
            # An instance attribute: AOTAutograd wraps a backward with functools.wraps,
            # which copies the instance's __dict__, not class attributes.
            self._boxed_call = True
            self._sub, self._future, self._constants = sub, future, constants
            self._backward, self._error = backward, None
            self._code = None
            self._post: tuple | None = None
            #: the compiled code's output strides (inductor's, as strings), once resolved
            self.output_strides = None

        def done(self) -> bool:
            if self._code is not None or self._error is not None:
                return True
            if self._backward is not None:
                if not self._backward.forward.done():
                    return False
                self._send()
                return self._error is not None
            return self._future.done()

        def _send(self) -> None:
            backward, self._backward = self._backward, None
            try:
                backward.forward.resolve()
                inputs = backward.restrided(backward.forward.output_strides)
                pickled = backward.pickled(inputs)
            except Exception as e:  # noqa: BLE001 - raised by resolve(), where the caller expects it
                self._error = e
                return
            if self._post is not None:
                self._post = (inputs, *self._post[1:])
            self._future = self._sub._send_to_child_async(pickled)

        def resolve(self) -> None:
            if self._code is not None:
                return
            if self._backward is not None:
                self._send()
            if self._error is not None:
                raise self._error
            out = self._future.result().deserialize(self._constants)
            self._sub._postprocess(out)
            code = out.graph
            self.output_strides = getattr(code, "output_strides", None)
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
        hold = bool(graph_kwargs.get("is_backward")) and "pending" in forward
        with _held_wire(wire_input) if hold else contextlib.nullcontext() as held:
            serialized = sub.serialize_compile(gm, example_inputs, inputs_to_check, graph_kwargs)
        if not serialized:
            raise InductorUnavailable("inductor cannot send this graph to its subprocess")
        inputs, constants = serialized
        if hold:
            backward = _Backward(held, forward["pending"], forward["outputs"], gm)
            pending = Pending(sub, None, constants, backward=backward)
        else:
            pending = Pending(sub, sub._send_to_child_async(inputs), constants)
            forward.update(pending=pending, outputs=_output_names(gm))
        job._pending.append(pending)
        return pending

    copy = torch.fx.GraphModule(gm, _copy_graph(gm.graph))
    real = compile_fx.fx_codegen_and_compile
    compile_fx.fx_codegen_and_compile = codegen
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_prims_picklable())
            # The backward is traced now too (AOTAutograd compiles it at its first run).
            stack.enter_context(torch._functorch.config.patch(force_non_lazy_backward_lowering=True))
            stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
            job.fn = torch._dynamo.disable(compile_fx.compile_fx)(copy, list(example_inputs))
    finally:
        compile_fx.fx_codegen_and_compile = real
    return job


def _output_names(gm: torch.fx.GraphModule) -> list[str | None]:
    """The names of the nodes a graph returns, in order (None where not a node)."""
    (outputs,) = gm.graph.output_node().args
    return [a.name if isinstance(a, torch.fx.Node) else None for a in outputs]


class _Backward:
    """A backward graph's compile, pickled but for its example inputs: the tensors it
    reads from the forward take the strides the forward's compiled code gives them, as
    AOTAutograd does (``_aot_stage2b_bw_compile``) when the forward's code is at hand. A
    saved tensor is a placeholder of the backward named as the forward's node."""

    def __init__(self, held, forward, forward_outputs: list[str | None], gm: torch.fx.GraphModule):
        self.wire, self._serialize, self.forward = held.wire, held.serialize, forward
        self._forward_outputs = forward_outputs
        self._names = [n.name for n in gm.graph.find_nodes(op="placeholder")]

    def restrided(self, strides) -> list:
        inputs = list(self.wire.example_inputs)
        if not strides:
            return inputs
        where = {name: k for k, name in enumerate(self._forward_outputs) if name is not None}
        for i, (name, x) in enumerate(zip(self._names, inputs)):
            k = where.get(name)
            if k is None or k >= len(strides) or strides[k] is None or not isinstance(x, torch.Tensor):
                continue
            stride = tuple(int(e) for e in strides[k])
            if stride != tuple(x.stride()):
                # A new tensor of those strides, not a view (AOTAutograd's as_strided): a
                # fake tensor's view does not pickle.
                mode = getattr(x, "fake_mode", None)
                with mode if mode is not None else contextlib.nullcontext():
                    inputs[i] = torch.empty_strided(x.size(), stride, dtype=x.dtype, device=x.device)
        return inputs

    def pickled(self, inputs: list):
        self.wire.example_inputs = inputs
        with _prims_picklable():
            return self._serialize(self.wire)


@contextlib.contextmanager
def _held_wire(wire_input):
    """While inductor prepares a graph for its subprocess, keep the unpickled message
    (``held.wire``) instead of pickling it; ``held.serialize`` pickles it later."""
    real = wire_input.serialize
    held = types.SimpleNamespace(wire=None, serialize=real)

    def hold(self):
        held.wire = self
        return self

    wire_input.serialize = hold
    try:
        yield held
    finally:
        wire_input.serialize = real


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
