"""The one support checker: which FX nodes ORT may run, and why not (a typed Reason).

A node is supported when its inputs and outputs pass the seed's ``IsFusable`` rules
(dtypes, devices, layouts, argument kinds), it neither mutates an input nor draws random
numbers, ORT has kernels for its dtype, torch_lib's translation of it is not known to be
wrong (``known_wrong``) and torch_lib's registry (the one ``lort.translate`` translates
with) has a translation for it. The fuser groups what this accepts; the decompositions
ask it which ops torch_lib translates (``implemented_overload_names``); a node whose
group later fails to translate or to build an ORT session gets ``translation_failed``.
"""

from __future__ import annotations

import functools
import json
import logging
import operator
import subprocess
import sys
from typing import Any

import onnx
import torch
import torch.fx

from ..reasons import Reason, ReasonKind
from ..runtime import providers
from ..runtime.dtypes import CUDA_ONLY_DTYPES, SUPPORTED_DTYPES, TABLE
from ..translate import _compat, attention, registry
from . import known_wrong

logger = logging.getLogger("lort")

#: Ops that need no translation and are handled by the fuser: tuple indexing.
_GETITEM = operator.getitem

#: Scalar constants that may stand as literal arguments of a fused node.
_CONSTANT_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def is_constant(arg: Any) -> bool:
    """A literal argument that is inlined into the group (the seed's 'constant')."""
    if isinstance(arg, _CONSTANT_TYPES):
        return True
    if isinstance(arg, (list, tuple)):
        return all(is_constant(a) for a in arg)
    return False


def _tensor_metas(val: Any) -> list[torch.Tensor] | None:
    """The tensors of a node's meta value, or None if it holds anything else."""
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)) and val and all(isinstance(v, torch.Tensor) for v in val):
        return list(val)
    return None


#: Complex dtypes go to ORT as float pairs (a trailing dimension of 2, as torch.onnx
#: translates them): a group's complex inputs and outputs cross its boundary through
#: view_as_real / view_as_complex (fusion/fuser.py), and inside it only nodes with a
#: torch_lib translation for complex inputs run (``_complex_reason``).
COMPLEX_DTYPES = frozenset({torch.complex64, torch.complex128})

#: Ops that make complex tensors from real ones in the float-pair form: their real
#: translation gives the trailing dimension of 2 (any other op's real translation would
#: build an ONNX complex type, which ORT does not compute with).
_COMPLEX_FROM_REAL = frozenset({"aten::_fft_r2c", "aten::view_as_complex", "aten::scalar_tensor"})
#: Arithmetic whose Python number torch.onnx's type promotion turns into a scalar_tensor
#: of the complex dtype, which lort translates as float pairs (translate/exact_scalars.py).
_PROMOTED_NUMBERS = frozenset({torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor,
                               torch.ops.aten.div.Tensor})


def _check_tensor(t: torch.Tensor, what: str) -> Reason | None:
    if t.dtype in COMPLEX_DTYPES:
        pass
    elif t.dtype not in SUPPORTED_DTYPES and not (t.dtype in CUDA_ONLY_DTYPES and t.device.type == "cuda"):
        where = "" if t.dtype not in CUDA_ONLY_DTYPES else " on CPU (ORT's CPU provider lacks its kernels)"
        return Reason(ReasonKind.DTYPE, f"{what} has dtype {t.dtype}, which lort does not send to ORT{where}")
    if t.device.type not in ("cpu", "cuda"):
        return Reason(ReasonKind.DEVICE, f"{what} is on device {t.device}, which has no ORT execution provider in lort")
    if t.layout != torch.strided:
        return Reason(ReasonKind.ARGUMENT, f"{what} has layout {t.layout}; only dense tensors go to ORT")
    return None


def _check_arg(arg: Any, where: str) -> Reason | None:
    """The seed's IsFusable: tensors, non-constant int/float scalars, or constants."""
    if isinstance(arg, torch.fx.Node):
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor):
            return _check_tensor(val, where)
        if isinstance(val, (torch.SymInt, torch.SymFloat, int, float)) and not isinstance(val, bool):
            return None
        return Reason(ReasonKind.ARGUMENT, f"{where} is {type(val).__name__}, not a tensor or int/float scalar")
    if isinstance(arg, (list, tuple)):
        for i, a in enumerate(arg):
            reason = _check_arg(a, f"{where}[{i}]")
            if reason:
                return reason
        return None
    if is_constant(arg):
        return None
    return Reason(ReasonKind.ARGUMENT, f"{where} is a {type(arg).__name__} constant")


#: ATen ops whose torch_lib translation rests on one ONNX operator that ORT has kernels for
#: in some dtypes only (its CPU Acos, Erf, Conv, AveragePool are float32 only; Gemm has no
#: int64; Ceil and Floor no integers; MaxPool no int64; GridSample at opset 18 float32
#: only): for other dtypes the node stays in PyTorch, instead of failing to build its
#: session. The dtypes are read from ORT's kernel registry.
_ORT_OP_OF = {
    "aten::erf": "Erf", "aten::acos": "Acos", "aten::acosh": "Acosh", "aten::asin": "Asin",
    "aten::asinh": "Asinh", "aten::atan": "Atan", "aten::atanh": "Atanh", "aten::cosh": "Cosh",
    "aten::sinh": "Sinh", "aten::tan": "Tan", "aten::addmm": "Gemm", "aten::convolution": "Conv",
    "aten::avg_pool2d": "AveragePool", "aten::avg_pool3d": "AveragePool", "aten::col2im": "Col2Im",
    "aten::_upsample_bilinear2d_aa": "Resize", "aten::upsample_bilinear2d": "Resize",
    "aten::upsample_nearest2d": "Resize", "aten::upsample_bicubic2d": "Resize",
    "aten::upsample_linear1d": "Resize", "aten::upsample_trilinear3d": "Resize",
    "aten::upsample_nearest1d": "Resize", "aten::upsample_nearest3d": "Resize",
    "aten::ceil": "Ceil", "aten::floor": "Floor", "aten::native_group_norm": "InstanceNormalization",
    "aten::gelu": "Erf", "aten::round": "Round", "aten::isnan": "IsNaN",
    "aten::max_pool2d_with_indices": "MaxPool", "aten::max_pool3d_with_indices": "MaxPool",
    "aten::grid_sampler_2d": "GridSample",
}

#: The type constraint of an ONNX operator's first input, by the names ONNX gives it.
_FIRST_INPUT_CONSTRAINTS = ("T", "T1")


_READ_KERNEL_DEFS = """
import json
from onnxruntime.capi import _pybind_state
print(json.dumps([(k.op_name, k.domain, k.provider, list(k.version_range), dict(k.type_constraints))
                  for k in _pybind_state.get_all_opkernel_def()]))
"""


@functools.lru_cache(maxsize=1)
def _kernel_defs() -> list | None:
    """ORT's kernel registry as (op, domain, provider, (low, high), type constraints) rows,
    or None when it cannot be read. With the CPU build it is read in this process. With a
    GPU build (onnxruntime-gpu 1.31.1 beside torch 2.11 CUDA on an H200),
    ``get_all_opkernel_def()`` crashed the process (a segmentation fault): there it is read
    in a child process, and a crash there only costs the registry (the session build
    decides)."""
    try:
        import onnxruntime

        if set(onnxruntime.get_available_providers()) <= {"CPUExecutionProvider"}:
            from onnxruntime.capi import _pybind_state

            return [(k.op_name, k.domain, k.provider, tuple(k.version_range), dict(k.type_constraints))
                    for k in _pybind_state.get_all_opkernel_def()]
        done = subprocess.run([sys.executable, "-c", _READ_KERNEL_DEFS], capture_output=True, text=True,
                              timeout=120, check=False)
        if done.returncode != 0:
            logger.info("lort: ORT's kernel registry could not be read (a child process exited with %s: %s); "
                        "session builds decide which kernels exist", done.returncode, done.stderr[-500:])
            return None
        return [(op, domain, prov, tuple(rng), cons) for op, domain, prov, rng, cons in json.loads(done.stdout)]
    except Exception as e:  # noqa: BLE001 - a private ORT API; without it the session build decides
        logger.info("lort: ORT's kernel registry could not be read (%r); session builds decide", e)
        return None


@functools.lru_cache(maxsize=None)
def _ort_kernel_types(op_type: str, provider: str, opset: int = _compat.OPSET) -> frozenset | None:
    """The tensor types of the first input that ORT's ``provider`` has a kernel of ONNX
    ``op_type`` for, at the version ``opset`` selects (the constraint named ``T`` or
    ``T1``; all of them for an operator with neither), or None when ORT's kernel registry
    cannot be read. MaxPool's int64 ``I`` (its indices) is not an input type."""
    kernels = _kernel_defs()
    if kernels is None:
        return None
    types: set = set()
    for op_name, domain, kernel_provider, (low, high), constraints in kernels:
        if op_name != op_type or domain not in ("", "ai.onnx") or kernel_provider != provider:
            continue
        if not low <= opset <= high:
            continue
        first = next((n for n in _FIRST_INPUT_CONSTRAINTS if n in constraints), None)
        for name, allowed in constraints.items():
            if first is None or name == first:
                types.update(allowed)
    return frozenset(types)


@functools.lru_cache(maxsize=None)
def onnx_allows(op_type: str, dtype: torch.dtype, opset: int = _compat.OPSET) -> bool:
    """Whether ONNX's schema of ``op_type`` (default domain, at ``opset``) takes ``dtype``
    as its first input; True for an operator ONNX has no schema of. No provider has a
    kernel the schema refuses (ONNX's Conv and MaxPool take no bfloat16: ORT refuses such
    a model at the session build, as it did on an H200 under autocast)."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except Exception:  # noqa: BLE001 - onnx.defs.SchemaError: not an ONNX operator
        return True
    first = schema.inputs[0].type_str if schema.inputs else ""
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}.get(first, {first})
    return dtype in TABLE and TABLE[dtype].ort_name in allowed


def ort_has_kernel(op_type: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ORT's provider for ``device`` has a kernel of ONNX ``op_type`` for
    ``dtype`` (its first input's type), at lort's opset: never where ONNX's schema refuses
    the type; else True where the registry cannot be read (the session build decides).
    The decompositions ask it where they rewrite an op over kernels ORT has."""
    if not onnx_allows(op_type, dtype):
        return False
    provider = "CUDAExecutionProvider" if device.type == "cuda" else "CPUExecutionProvider"
    types = _ort_kernel_types(op_type, provider)
    return not types or (TABLE[dtype].ort_name if dtype in TABLE else "") in types


def _ort_dtype_reason(node: torch.fx.Node) -> Reason | None:
    op_type = _ORT_OP_OF.get(node.target._schema.name)
    if op_type == "Erf" and node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none") == "tanh":
        return None  # gelu's tanh form has no Erf
    args = [a for a in node.args if isinstance(a, torch.fx.Node)]
    val = args[0].meta.get("val") if args else None
    if op_type is None or not isinstance(val, torch.Tensor):
        return None
    if ort_has_kernel(op_type, val.dtype, val.device):
        return None
    if not onnx_allows(op_type, val.dtype):
        return Reason(ReasonKind.NO_KERNEL, f"ONNX's {op_type} (opset {_compat.OPSET}) takes no {val.dtype} "
                                            f"(its translation needs one)")
    provider = "CUDAExecutionProvider" if val.device.type == "cuda" else "CPUExecutionProvider"
    return Reason(ReasonKind.NO_KERNEL, f"ORT's {provider} has no {op_type} kernel for {val.dtype} (its translation needs one)")


def _complex_reason(node: torch.fx.Node, outs: list[torch.Tensor]) -> Reason | None:
    """Why a node with complex tensors stays in PyTorch, or None. torch_lib translates a
    node with a complex input by its complex overload (float pairs), which takes every
    tensor input as a complex one; a node with real inputs only by its real one, which
    gives float pairs for ``_COMPLEX_FROM_REAL`` only."""
    inputs = [a.meta.get("val") for a in node.all_input_nodes]
    inputs = [v for v in inputs if isinstance(v, torch.Tensor)]
    complex_in = [v.dtype in COMPLEX_DTYPES for v in inputs]
    if any(complex_in):
        if not all(complex_in):
            return Reason(ReasonKind.DTYPE, "mixes complex and real tensor inputs (torch_lib's complex "
                                            "translations take complex inputs only)")
        values = {a.name: (node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value))
                  for i, a in enumerate(node.target._schema.arguments)}
        for arg in node.target._schema.arguments:
            if (isinstance(arg.type, torch.TensorType) and isinstance(values[arg.name], (int, float))
                    and node.target not in _PROMOTED_NUMBERS):
                return Reason(ReasonKind.ARGUMENT, f"argument {arg.name!r} is a Python number, where torch_lib's "
                                                   "complex translation takes a complex tensor")
        if node.target is torch.ops.aten.constant_pad_nd.default and values.get("value") not in (None, 0):
            return Reason(ReasonKind.ARGUMENT, "pads a complex tensor with a value other than 0 (lort's "
                                               "complex form pads both parts alike)")
        return None
    if any(t.dtype in COMPLEX_DTYPES for t in outs) and node.target._schema.name not in _COMPLEX_FROM_REAL:
        return Reason(ReasonKind.DTYPE, "makes a complex tensor from real ones, which torch_lib translates "
                                        "to an ONNX complex type ORT does not compute with")
    return None


#: Attention kernels tagged random for their dropout: with ``dropout_p`` 0 (every
#: inference graph's) they draw nothing.
_DROPOUT_ARG = {attention.FLASH_FOR_CPU: 3}


def _no_dropout(node: torch.fx.Node) -> bool:
    index = _DROPOUT_ARG.get(node.target)
    if index is None:
        return False
    p = node.args[index] if len(node.args) > index else node.kwargs.get("dropout_p", 0.0)
    return isinstance(p, (int, float)) and p == 0


def draws_random(node: torch.fx.Node) -> bool:
    """Whether ``node`` draws from PyTorch's RNG (a random op; CPU flash attention with a
    dropout probability of 0 does not)."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in target.tags and not _no_dropout(node))


def unsupported_reason(node: torch.fx.Node) -> Reason | None:
    """None if ``node`` may run in an ORT group, else why it stays in PyTorch (the rules
    that need only the node; ``SupportChecker`` adds the options' device rule)."""
    if node.op != "call_function":
        return Reason(ReasonKind.NOT_ATEN, f"{node.op} node")
    target = node.target
    if target is _GETITEM:
        src = node.args[0]
        if isinstance(src, torch.fx.Node) and src.op == "call_function" and _tensor_metas(src.meta.get("val")):
            return unsupported_reason(src)
        return Reason(ReasonKind.NOT_ATEN, "indexes a value that is not a tuple of tensors")
    if not isinstance(target, torch._ops.OpOverload):
        return Reason(ReasonKind.NOT_ATEN, f"{getattr(target, '__name__', target)!s} is not an ATen operator")
    schema = target._schema
    if schema.is_mutable:
        return Reason(ReasonKind.MUTATION, "mutates an input; ORT groups are functional")
    if draws_random(node):
        return Reason(ReasonKind.RANDOM, "random op; kept in PyTorch so results follow PyTorch's RNG")
    outs = _tensor_metas(node.meta.get("val"))
    if outs is None:
        return Reason(ReasonKind.ARGUMENT, "output is not a tensor (or tuple of tensors)")
    for i, t in enumerate(outs):
        reason = _check_tensor(t, f"output {i}")
        if reason:
            return reason
    for i, a in enumerate(node.args):
        reason = _check_arg(a, f"argument {i}")
        if reason:
            return reason
    for k, a in node.kwargs.items():
        reason = _check_arg(a, f"argument {k!r}")
        if reason:
            return reason
    devices = {t.device for t in outs}
    devices |= {
        a.meta["val"].device
        for a in node.all_input_nodes
        if isinstance(a.meta.get("val"), torch.Tensor)
    }
    if len(devices) > 1:
        return Reason(ReasonKind.DEVICE, f"mixes devices {sorted(map(str, devices))}")
    reason = _ort_dtype_reason(node) or _complex_reason(node, outs)
    if reason:
        return reason
    wrong = known_wrong.reason(node)
    if wrong:
        return Reason(ReasonKind.KNOWN_WRONG, wrong)
    fn, message = registry.dispatch(node)
    if fn is None:
        return Reason(ReasonKind.NO_TRANSLATION, message)
    return None


def translation_failed(error: Exception) -> Reason:
    """The reason of a node that failed to translate or build a session on its own."""
    return Reason(ReasonKind.TRANSLATION_FAILED, f"translation failed: {error}")


def group_failed(error: Exception) -> Reason:
    """The reason of the nodes of a group that failed as a whole (no single node did)."""
    return Reason(ReasonKind.GROUP_FAILED, f"its group failed as a whole: {error}")


def implemented_overload_names(store=None) -> tuple[str, ...]:
    """The ATen overloads torch_lib translates correctly, as names ("aten::add.Tensor"):
    the decompositions keep these whole. Building them takes torch_lib's whole registry
    (seconds): ``store`` (a disk cache: ``versions_key``, ``load_record``,
    ``store_record``) keeps them per library versions so that a warm start skips it."""
    key = store.versions_key("torch_lib implemented overloads") if store is not None else None
    record = store.load_record(key) if store is not None else None
    ops = record.get("ops") if record else None
    if isinstance(ops, list) and all(isinstance(o, str) for o in ops):
        return tuple(ops)
    names = _implemented_overload_names()
    if store is not None:
        store.store_record(key, {"ops": list(names)})
    return names


@functools.lru_cache(maxsize=1)
def _implemented_overload_names() -> tuple[str, ...]:
    return tuple(sorted(op.name() for op in registry.implemented_overloads() - known_wrong.always_wrong()))


class SupportChecker:
    """The support decision for one options set: ``unsupported_reason`` plus the device
    rule (a node on a device with no ORT provider stays in PyTorch, unless the options
    name the providers)."""

    def __init__(self, provider_override: tuple | None = None):
        self.provider_override = provider_override

    def reason(self, node: torch.fx.Node) -> Reason | None:
        return unsupported_reason(node) or self._device_reason(node)

    def _device_reason(self, node: torch.fx.Node) -> Reason | None:
        if self.provider_override:
            return None
        val = node.meta.get("val")
        for v in val if isinstance(val, (tuple, list)) else [val]:
            if isinstance(v, torch.Tensor):
                why = providers.device_check(v.device)
                return Reason(ReasonKind.DEVICE, why) if why else None
        return None


def op_name(node: torch.fx.Node) -> str:
    """A short name for a node's operator, e.g. 'aten.mm.default'."""
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            return str(target)
        return getattr(target, "__name__", str(target))
    return f"{node.op}:{node.target}"
