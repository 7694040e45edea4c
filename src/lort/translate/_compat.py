"""The one place that touches private APIs of torch.onnx and onnxscript.

torch.onnx's dynamo exporter holds the maintained machinery that turns an FX graph of
ATen ops into ONNX through onnxscript's torch_lib: the registry of ATen -> ONNX
functions, the dispatcher that picks one for an FX node, the node-by-node graph
translator and the ONNX-friendly decomposition table. These live under
``torch.onnx._internal.exporter`` and change between releases, so every use goes
through this module. ``check_versions()`` fails with a clear message when the installed
torch does not have what lort needs.
"""

from __future__ import annotations

import functools
import logging
import operator
from typing import Any, Callable

import torch

from ..errors import UnsupportedVersionError

try:  # pragma: no cover - exercised by the import itself
    import onnx_ir as ir
    from torch.onnx._internal.exporter import _constants as _ex_constants
    from torch.onnx._internal.exporter import _core as _ex_core
    from torch.onnx._internal.exporter import _decomp as _ex_decomp
    from torch.onnx._internal.exporter import _dispatching as _ex_dispatching
    from torch.onnx._internal.exporter import _fx_passes as _ex_fx_passes
    from torch.onnx._internal.exporter import _ir_passes as _ex_ir_passes
    from torch.onnx._internal.exporter import _registration as _ex_registration

    _IMPORT_ERROR: Exception | None = None
except Exception as e:  # pragma: no cover - only on an unsupported torch
    _IMPORT_ERROR = e

#: The ONNX opset lort emits; torch_lib's functions are written for it.
OPSET = 18
#: ORT 1.31 accepts IR versions up to 13 (`onnx.helper.make_model` defaults newer).
IR_VERSION = 10

_REQUIRED = (
    ("_core", "_translate_fx_graph"),
    ("_dispatching", "dispatch"),
    ("_registration", "ONNXRegistry"),
    ("_decomp", "create_onnx_friendly_decomposition_table"),
    ("_ir_passes", "add_opset_imports"),
    ("_fx_passes", "insert_type_promotion_nodes"),
)


def check_versions() -> None:
    """Raise UnsupportedVersionError if torch.onnx lacks the internals lort uses."""
    if _IMPORT_ERROR is not None:
        raise UnsupportedVersionError(
            f"lort needs torch.onnx's dynamo exporter internals, which failed to import on "
            f"torch {torch.__version__}: {_IMPORT_ERROR!r}. Install a torch version in the "
            f"range declared by lort's pyproject.toml."
        )
    modules = {
        "_core": _ex_core,
        "_dispatching": _ex_dispatching,
        "_registration": _ex_registration,
        "_decomp": _ex_decomp,
        "_ir_passes": _ex_ir_passes,
        "_fx_passes": _ex_fx_passes,
    }
    for mod, attr in _REQUIRED:
        if not hasattr(modules[mod], attr):
            raise UnsupportedVersionError(
                f"torch {torch.__version__} has no torch.onnx._internal.exporter.{mod}.{attr}, "
                f"which lort uses to translate ATen graphs; install a torch version in the "
                f"range declared by lort's pyproject.toml."
            )


@functools.lru_cache(maxsize=1)
def registry() -> Any:
    """torch_lib's ATen -> ONNX registry (built once; it takes about a second)."""
    check_versions()
    from . import exact_scalars

    reg = _ex_registration.ONNXRegistry.from_torchlib(OPSET)
    exact_scalars.register(reg)
    return reg


def _node_arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` (positional ``index``) of an FX node."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _is_float_output(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _is_float_arg(node: torch.fx.Node, index: int) -> bool:
    arg = node.args[index] if len(node.args) > index else None
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _arg_shape(node: torch.fx.Node, index: int) -> tuple | None:
    arg = node.args[index] if len(node.args) > index else None
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _arg_dtype(node: torch.fx.Node, index: int) -> torch.dtype | None:
    arg = node.args[index] if len(node.args) > index else None
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _uses_outputs(node: torch.fx.Node, indices: tuple[int, ...]) -> bool:
    """Whether any of the outputs ``indices`` of a multi-output node is used."""
    return any(
        u.target is operator.getitem and u.args[1] in indices and len(u.users) > 0 for u in node.users
    )


def _negative_pad(node: torch.fx.Node) -> bool:
    pads = _node_arg(node, 1, "padding")
    return isinstance(pads, (list, tuple)) and any(not isinstance(p, int) or p < 0 for p in pads)


def _when(predicate: Callable[[torch.fx.Node], bool], reason: str) -> Callable:
    """A known-wrong entry for the nodes ``predicate`` selects: those run in PyTorch."""
    return lambda node: reason if predicate(node) else None


@functools.lru_cache(maxsize=1)
def _known_wrong() -> dict:
    """torch_lib translations that give results different from PyTorch's, found by
    lort's op tests (tests/test_ops.py).

    A value is either a reason: the op is never translated and PyTorch's decomposition of
    it (into ops that translate correctly) is used instead; or a function of the FX node
    giving a reason or None, for ops that are wrong only for some arguments: the nodes it
    gives a reason for are left to PyTorch as they are (not decomposed)."""
    aten = torch.ops.aten
    floor_or_int = (
        lambda n: _node_arg(n, 2, "rounding_mode") == "floor"
        or (_node_arg(n, 2, "rounding_mode") == "trunc" and not _is_float_output(n))
    )
    div_mode = _when(
        floor_or_int,
        "torch_lib's div with rounding_mode computes integer division in float32 (wrong for "
        "|values| > 2**24, e.g. 33554435 // 2 -> 16777218) and float floor division as "
        "floor(a / b), where PyTorch rounds the exact quotient (7.0 // 0.1 is 69, not 70)",
    )
    float_floor = (
        "torch_lib computes float floor division as floor(a / b) and remainder as "
        "a - floor(a / b) * b; PyTorch works from fmod, exactly, so they differ when a / b "
        "rounds to an integer (7.0 // 0.1 is 69 in PyTorch, 70 in ORT; 7.0 % 0.1 is 0.1 vs 0)"
    )
    nan_order = (
        "ORT's TopK does not order NaN as PyTorch's sort/topk do (NaN is the largest value); "
        "float sort/topk run in PyTorch, since NaN is possible in any float input"
    )
    zero_dim_scatter = (
        "ONNX ScatterElements needs inputs of rank >= 1; torch_lib passes 0-d tensors as they "
        "are and ORT fails at run time (median's backward on a 0-d input)"
    )
    embedding_bag = (
        "torch_lib's embedding_bag sums in float32 whatever the dtype (float64 loses precision) "
        "and fills outputs 1-3 (offset2bag, bag_size, max_indices) with zeros of other shapes, "
        "which backward needs (ORT: 'invalid dimensions for output')"
    )
    negative_pad = (
        "ORT's Pad in edge mode fails at run time on negative (cropping) pads: 'Pad: invalid "
        "mode: 2 with zero effective input extent'"
    )
    return {
        aten._native_batch_norm_legit_functional.default: (
            "torch_lib's training-mode batch norm (ONNX BatchNormalization training_mode=1) "
            "differs from PyTorch's outputs; decomposed instead"
        ),
        aten.nll_loss_forward.default: (
            "torch_lib's nll_loss_forward returns a fake total_weight (the number of "
            "elements of the loss output: 1 for mean/sum reduction) instead of the sum of "
            "the weights of the non-ignored targets, so nll_loss_backward (and cross_entropy's "
            "gradient) is scaled wrongly, e.g. 4x for a batch of 4; decomposed instead"
        ),
        aten.mv.default: (
            "ORT 1.31's Transpose+MatMul fusion (graph optimization level 'extended' and up) "
            "gives wrong results when MatMul's second input is 1-D, as in mv(t(A), x), the "
            "vector gradient of mv and of matmul(matrix, vector); decomposed into mul+sum instead"
        ),
        aten.baddbmm.default: (
            "torch_lib's baddbmm computes beta * input even when beta == 0, so NaN/inf in "
            "input (e.g. a torch.empty buffer) propagate where PyTorch ignores input; decomposed "
            "instead"
        ),
        aten.addmv.default: (
            "torch_lib's addmv computes beta * input even when beta == 0, so NaN/inf in input "
            "propagate where PyTorch ignores input; decomposed instead"
        ),
        aten.addbmm.default: _when(
            lambda n: _node_arg(n, 3, "beta", 1) == 0,
            "torch_lib's addbmm computes beta * input even when beta == 0, so NaN/inf in input "
            "propagate where PyTorch ignores input",
        ),
        aten.atan2.default: _when(
            lambda n: True,
            "torch_lib's atan2 (atan(y / x) with quadrant fix-ups) is wrong for y == 0: "
            "atan2(0, -1) gives -pi instead of pi, and signed zeros are not followed",
        ),
        aten.div.Tensor_mode: div_mode,
        aten.div.Scalar_mode: div_mode,
        aten.floor_divide.default: _when(_is_float_output, float_floor),
        aten.remainder.Tensor: _when(_is_float_output, float_floor),
        aten.remainder.Scalar: _when(_is_float_output, float_floor),
        aten.avg_pool2d.default: _when(
            lambda n: _node_arg(n, 6, "divisor_override") is not None,
            "torch_lib's avg_pool2d ignores divisor_override",
        ),
        aten.avg_pool3d.default: _when(
            lambda n: _node_arg(n, 6, "divisor_override") is not None,
            "torch_lib's avg_pool3d ignores divisor_override",
        ),
        aten.scatter_reduce.two: _when(
            lambda n: _node_arg(n, 4, "reduce") == "mean",
            "torch_lib's scatter_reduce has no 'mean' reduction (ONNX ScatterElements has "
            "none): it scatters without averaging",
        ),
        aten.mean.dim: _when(
            lambda n: not _is_float_arg(n, 0),
            "torch_lib's mean of an integer tensor with dtype= averages in the integer type "
            "(ReduceMean truncates) and casts afterwards",
        ),
        # NaN ordering (lort's NaN decision for sort/topk; see README "NaN semantics").
        aten.sort.default: _when(lambda n: _is_float_arg(n, 0), nan_order),
        aten.sort.stable: _when(lambda n: _is_float_arg(n, 0), nan_order),
        aten.topk.default: _when(lambda n: _is_float_arg(n, 0), nan_order),
        aten.copy.default: _when(
            lambda n: _arg_shape(n, 0) != _arg_shape(n, 1),
            "torch_lib's copy is CastLike(src, self): it does not broadcast src to self's "
            "shape, so ORT fails at run time on copy_(x, y) with y of shape (4, 1) into x (4, 6)",
        ),
        # Found by the OpInfo conformance sweep (lort.testing.conformance).
        aten.special_erfcx.default: (
            "torch_lib's special_erfcx is exp(x**2) * (1 - erf(x)): inf * 0 = NaN from x ~ 9 "
            "(erfcx(30) gives NaN, PyTorch 0.0188) and cancellation from x ~ 3; decomposed (its "
            "prims.erfcx runs in PyTorch)"
        ),
        aten.erfc.default: (
            "torch_lib's erfc is 1 - erf(x), which loses all precision from x ~ 3 (erfc(5) is "
            "1.5e-12, torch_lib gives 0 in float32, so log(erfc(x)) and log_ndtr give -inf); "
            "decomposed (its prims.erfc runs in PyTorch)"
        ),
        aten.special_erfc.default: "torch_lib's special_erfc is 1 - erf(x) (see erfc); decomposed",
        aten.signbit.default: _when(
            lambda n: _is_float_arg(n, 0) or _arg_shape(n, 0) == (),
            "torch_lib's signbit is x < 0: False for -0.0 (and for a NaN with its sign bit set), "
            "and it compares with a constant of shape [1], so a 0-d input gives a 1-d output",
        ),
        aten.scatter.src: _when(lambda n: _arg_shape(n, 0) == (), zero_dim_scatter),
        aten.scatter.value: _when(lambda n: _arg_shape(n, 0) == (), zero_dim_scatter),
        aten.scatter_add.default: _when(lambda n: _arg_shape(n, 0) == (), zero_dim_scatter),
        aten._native_batch_norm_legit_no_training.default: _when(
            lambda n: _uses_outputs(n, (1, 2)) or _arg_dtype(n, 0) == torch.float64,
            "torch_lib's inference batch norm gives the running stats as outputs 1 and 2, where "
            "PyTorch gives empty tensors (ORT: 'invalid dimensions for output'), and its float64 "
            "model does not type-check in ORT",
        ),
        aten._embedding_bag.default: _when(lambda n: True, embedding_bag),
        aten._embedding_bag_forward_only.default: _when(lambda n: True, embedding_bag),
        aten.embedding_bag.padding_idx: _when(lambda n: True, embedding_bag),
        aten.replication_pad1d.default: _when(_negative_pad, negative_pad),
        aten.replication_pad2d.default: _when(_negative_pad, negative_pad),
        aten.replication_pad3d.default: _when(_negative_pad, negative_pad),
        aten.gelu.default: _when(
            lambda n: _arg_dtype(n, 0) == torch.float64 and _node_arg(n, 1, "approximate") == "tanh",
            "float64 gelu(approximate='tanh') through torch_lib and ORT is off by ~1e-7 relative "
            "(float32 precision: 1.963192137 where PyTorch gives 1.963192349)",
        ),
    }


def _float64_scalar_reason(node: torch.fx.Node) -> str | None:
    from . import exact_scalars

    return exact_scalars.float64_scalar_reason(node)


def dispatch(node: torch.fx.Node) -> tuple[Callable | None, str]:
    """The torch_lib function that translates ``node``, or None and the reason."""
    reg = registry()
    wrong = _known_wrong().get(node.target)
    if callable(wrong):
        wrong = wrong(node)
    wrong = wrong or _float64_scalar_reason(node)
    if wrong:
        return None, wrong
    if not reg.is_registered(node.target):
        return None, "no torch_lib translation registered"
    return _ex_dispatching.dispatch(node, reg)


def implemented_overload_names() -> list[str]:
    """The ATen overloads torch_lib translates correctly, as names ("aten::add.Tensor").
    Building them needs torch_lib's whole registry (seconds); the disk cache keeps them
    per library versions so that a warm start does not build it."""
    reg = registry()
    always_wrong = {op for op, why in _known_wrong().items() if isinstance(why, str)}
    ops = set(_ex_decomp.get_onnx_implemented_overloads(reg)) - always_wrong
    return sorted(op.name() for op in ops if isinstance(op, torch._ops.OpOverload))


def _overload(name: str) -> torch._ops.OpOverload:
    namespace, _, rest = name.partition("::")
    op, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")


def decomposition_table(implemented_names: tuple[str, ...] | None = None) -> dict:
    """PyTorch decompositions for exactly the ops torch_lib cannot translate (correctly),
    given those ops' names (``implemented_overload_names()`` when omitted)."""
    names = implemented_overload_names() if implemented_names is None else implemented_names
    implemented = {_overload(n) for n in names}
    return _ex_decomp.create_onnx_friendly_decomposition_table(implemented)


def fill_default_arguments(gm: torch.fx.GraphModule) -> None:
    """Write out positional arguments left at their schema default (AOTAutograd leaves
    e.g. ``amax``'s ``dim=[]`` out; some torch_lib functions require them)."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        schema_args = target._schema.arguments
        args, kwargs = list(node.args), dict(node.kwargs)
        for arg in schema_args[len(args):]:
            if arg.kwarg_only:
                break
            if arg.name in kwargs:
                args.append(kwargs.pop(arg.name))
            elif arg.has_default_value():
                args.append(arg.default_value)
            else:
                break
        node.args, node.kwargs = tuple(args), kwargs
    gm.recompile()


def insert_type_promotion(gm: torch.fx.GraphModule) -> None:
    """Make PyTorch's implicit type promotion explicit (ONNX ops take one dtype), with
    torch.onnx's own pass."""
    _ex_fx_passes.insert_type_promotion_nodes(gm)


def optimize_for_ort(model: ir.Model) -> tuple[ir.Model, dict[str, int]]:
    """onnxscript's ORT-specific fusion rewrites (in place) and their counts."""
    from onnxscript.rewriter.ort_fusions import optimize_for_ort as _optimize_for_ort

    _guard_fused_matmul_batch_rules()
    return _optimize_for_ort(model)


def _guard_fused_matmul_batch_rules() -> None:
    """onnxscript 0.7.2's Transpose-into-FusedMatMul rules that set transBatchA/B do
    not check ranks, while ORT's FusedMatMul needs both inputs of one rank >= 3 when a
    transBatch flag is set ("Two inputs should have same rank and rank >= 3"): a
    rank-3 x rank-2 product became a model ORT fails to run. The rules' conditions get
    that check (once; idempotent)."""
    from onnxscript.rewriter import pattern as orp
    from onnxscript.rewriter.ort_fusions import _core as ort_core
    from onnxscript.rewriter.ort_fusions import fused_matmul_rule_sets as fmm

    batch_rule = getattr(fmm, "_TransposeFusedMatMulBaseWithBatch", None)
    if batch_rule is None:
        return
    for rule in ort_core.ORT_PATTERN_REWRITE_RULES:
        condition = getattr(rule, "_condition_function", None)
        if not isinstance(getattr(condition, "__self__", None), batch_rule) or getattr(condition, "_lort", False):
            continue

        def guarded(context, x, y, *args, _check=condition, **kwargs):
            ranks = {len(v.shape) if v.shape is not None else None for v in (x, y)}
            if len(ranks) != 1 or None in ranks or next(iter(ranks)) < 3:
                return orp.MatchResult().fail("lort: FusedMatMul with transBatch needs inputs of one rank >= 3")
            return _check(context, x, y, *args, **kwargs)

        guarded._lort = True
        rule._condition_function = guarded


def translate_graph(fx_graph: torch.fx.Graph, name: str) -> ir.Model:
    """Translate an FX graph of ATen ops (placeholders, call_function, output) to ONNX IR.

    Placeholders become graph inputs in order; the output node's values become graph
    outputs in order. Shapes and dtypes come from each node's ``meta["val"]``.
    """
    check_versions()
    model = ir.Model(
        graph=ir.Graph([], [], nodes=[], name=name),
        ir_version=IR_VERSION,
        producer_name="lort",
        producer_version=_lort_version(),
    )
    # The exporter warns for every node without nn_module_stack metadata, which
    # AOTAutograd graphs never have.
    core_logger = logging.getLogger(_ex_core.__name__)
    level = core_logger.level
    core_logger.setLevel(logging.ERROR)
    try:
        _ex_core._translate_fx_graph(
            fx_graph,
            model,
            graph_like=model.graph,
            owned_graphs={},
            lower="at_conversion",
            registry=registry(),
        )
    finally:
        core_logger.setLevel(level)
    _ex_ir_passes.add_opset_imports(model)
    return model


def _lort_version() -> str:
    from .. import __version__

    return __version__
