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
import threading
from typing import Any, Callable

import numpy as np
import torch

from .._version import __version__
from ..errors import UnsupportedVersionError

try:  # pragma: no cover - exercised by the import itself
    import onnx_ir as ir
    import onnx_ir.passes.common as common_passes
    from torch.onnx._internal.exporter import _core as _ex_core
    from torch.onnx._internal.exporter import _decomp as _ex_decomp
    from torch.onnx._internal.exporter import _dispatching as _ex_dispatching
    from torch.onnx._internal.exporter import _fx_passes as _ex_fx_passes
    from torch.onnx._internal.exporter import _ir_passes as _ex_ir_passes
    from torch.onnx._internal.exporter import _registration as _ex_registration

    _IMPORT_ERROR: Exception | None = None
except Exception as e:  # pragma: no cover - only on an unsupported torch
    _IMPORT_ERROR = e

logger = logging.getLogger("lort")

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


def torchlib_registry() -> Any:
    """A new registry of torch_lib's ATen -> ONNX functions (about a second to build;
    translate/registry.py keeps one, with lort's own translations added)."""
    check_versions()
    return _ex_registration.ONNXRegistry.from_torchlib(OPSET)


def dispatch(node: torch.fx.Node, reg: Any) -> tuple[Callable | None, str]:
    """The function of ``reg`` that translates ``node``, or None and torch_lib's reason.
    (Whether that translation is right is lort.fusion.support's question.)"""
    if not reg.is_registered(node.target):
        return None, "no torch_lib translation registered"
    return _ex_dispatching.dispatch(node, reg)


def implemented_overloads(reg: Any) -> set:
    """The ATen overloads ``reg`` has translations for."""
    return {op for op in _ex_decomp.get_onnx_implemented_overloads(reg) if isinstance(op, torch._ops.OpOverload)}


def _overload(name: str) -> torch._ops.OpOverload:
    namespace, _, rest = name.partition("::")
    op, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")


def decomposition_table(implemented_names: tuple[str, ...]) -> dict:
    """PyTorch's ONNX-friendly decompositions of the ops not in ``implemented_names``
    (ATen overload names, e.g. "aten::add.Tensor")."""
    implemented = set()
    for name in implemented_names:
        try:
            implemented.add(_overload(name))
        except AttributeError:
            # An op whose library this process has not loaded (the names may come from
            # the disk cache of a process that had, e.g. quantized_decomposed after
            # inductor's import) cannot be in a graph traced here.
            continue
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


#: The most elements a constant folded by onnxscript's optimizer (inside
#: optimize_for_ort) may hold, in place of its default 512 * 512: the optimizer
#: materialized BERT-base's attention-mask ``zeros_like`` as twelve 768 KiB float32
#: constants, held in the model bytes and in ORT's session (about 60 MB more resident
#: after BERT-base's first call; 12 MiB each at 512 tokens). ORT computes such a
#: ConstantOfShape or Expand at run time for less than the memory costs.
FOLD_OUTPUT_SIZE_LIMIT = 8192
_FOLD_LIMIT_LOCK = threading.Lock()


def optimize_for_ort(model: ir.Model, skip_norms: bool = True) -> tuple[ir.Model, dict[str, int]]:
    """onnxscript's ORT-specific fusion rewrites (in place) and their counts; its
    optimizer folds no constant of more than FOLD_OUTPUT_SIZE_LIMIT elements.
    ``skip_norms=False`` leaves out its two skip-norm fusions (see SKIP_NORM_FUSIONS)."""
    from onnxscript import optimizer, rewriter
    from onnxscript.rewriter.ort_fusions import _core as ort_core
    from onnxscript.rewriter.ort_fusions import optimize_for_ort as _optimize_for_ort

    _guard_fused_matmul_batch_rules()
    _exact_no_op_rules()
    # optimize_for_ort passes no limit to the optimize() it calls; its keyword default
    # is the one way in, set for the call (one lort rewrite at a time).
    # Its optimizer reads the default rewrite rules from the module at each call: the
    # same way in, for the rules it runs without the quadratic ones.
    with _FOLD_LIMIT_LOCK:
        saved = optimizer.optimize.__kwdefaults__
        rules = rewriter._DEFAULT_REWRITE_RULES
        optimizer.optimize.__kwdefaults__ = {**(saved or {}), "output_size_limit": FOLD_OUTPUT_SIZE_LIMIT}
        quadratic = _quadratic_rules()
        rewriter._DEFAULT_REWRITE_RULES = tuple(r for r in rules if r not in quadratic)
        # fuse_xformers calls its fusions by their names in its module.
        fusions = {name: getattr(ort_core, name) for name in SKIP_NORM_FUSIONS}
        if not skip_norms:
            for name in fusions:
                setattr(ort_core, name, _no_fusion)
        try:
            fused, counts = _optimize_for_ort(model)
        finally:
            optimizer.optimize.__kwdefaults__ = saved
            rewriter._DEFAULT_REWRITE_RULES = rules
            for name, fn in fusions.items():
                setattr(ort_core, name, fn)
    return fused, {**counts, **_onnx_fusions(fused)}


def _onnx_fusions(model: ir.Model) -> dict[str, int]:
    """onnxscript's fusions to ONNX's own ops, which it applies to models importing the
    default domain at opset 23 (those holding ONNX's Attention: translate/attention.py),
    in place, and their counts. The one that fires on lort's graphs is a Hugging Face
    decoder's rotary embedding (``x * cos + rotate_half(x) * sin``, about seven nodes
    each for the query and the key of every layer) as one RotaryEmbedding node: a decode
    step of an 8-layer int4 decoder 1536 wide (274 nodes for 371) ran 2.8% faster in ORT
    (median of 30 interleaved rounds; within noise on a 28-layer one). The fused nodes
    recompute the cosine and sine of the angles each: common subexpressions are merged
    after. Below opset 23 nothing changes; a failure leaves the model as it was."""
    from onnxscript.rewriter import onnx_fusions

    if model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0)) < 23:
        return {}
    try:
        counts = onnx_fusions.fuse(model)
    except Exception as e:  # noqa: BLE001 - an optimization: the model is left unfused
        logger.info("lort: onnxscript's ONNX fusions failed on %s: %s", model.graph.name, e)
        return {}
    if any(counts.values()):
        common_passes.CommonSubexpressionEliminationPass()(model)
        _rotary_angles_per_row(model)
        common_passes.RemoveUnusedNodesPass()(model)
    return {f"onnx:{name}": n for name, n in counts.items()}


def _known(dim) -> bool:
    """Whether a dimension of onnx-ir's shapes is a number or a named symbol."""
    return isinstance(dim, int) or getattr(dim, "value", None) is not None


def _rotary_angles_per_row(model: ir.Model) -> None:
    """Each RotaryEmbedding node's cosines and sines ([batch, sequence, head size / 2]),
    expanded to its input's batch and sequence where their shapes do not show them
    equal: the fused ops broadcast angles of one row (position ids of batch 1, as a
    forward without ``position_ids`` makes) over the batch, which ORT's RotaryEmbedding
    refuses. One Expand per angles and shape where the shape is static."""
    from .external_data import initializer

    static: dict[tuple, ir.Value] = {}
    for node in list(model.graph):
        if node.op_type != "RotaryEmbedding" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 3:
            continue
        x = node.inputs[0]
        if x is None or x.shape is None or len(x.shape) != 4:
            continue
        # the fusion checks the head size is static; the angles it makes have no shape
        half = x.shape[3] // 2 if isinstance(x.shape[3], int) else None
        want = (x.shape[0], x.shape[2], half)
        for slot in (1, 2):
            angles = node.inputs[slot]
            if angles.shape is not None and tuple(angles.shape) == want and all(_known(d) for d in want):
                continue
            made = []
            if all(isinstance(d, int) for d in want):
                key = (id(angles), want)
                if key not in static:
                    target = initializer(model.graph, "rotary_rows_shape", np.array(want, dtype=np.int64))
                    made = [ir.node("Expand", [angles, target])]
                    static[key] = made[0].outputs[0]
                expanded = static[key]
            else:
                made = [ir.node("Shape", [x], attributes={"start": 0, "end": 1}),
                        ir.node("Shape", [x], attributes={"start": 2, "end": 3}),
                        ir.node("Shape", [angles], attributes={"start": 2, "end": 3})]
                made.append(ir.node("Concat", [m.outputs[0] for m in made], attributes={"axis": 0}))
                made.append(ir.node("Expand", [angles, made[-1].outputs[0]]))
                expanded = made[-1].outputs[0]
            expanded.type, expanded.shape = angles.type or x.type, ir.Shape(list(want))
            if made:
                model.graph.insert_before(node, made)
            node.replace_input_with(slot, expanded)

#: onnxscript's fusions of a residual Add and the norm after it into ORT's
#: SkipLayerNormalization / SkipSimplifiedLayerNormalization. ORT 1.31's CPU kernels of
#: those run slower than its Add and LayerNormalization (or SimplifiedLayerNormalization)
#: kernels they replace, 24 of each, 2 threads (benchmarks/studies/skip_norm.md): 0.48 against
#: 0.12 ms at 17x192, 6.5 against 1.9 ms at 128x768; 0.54 against 0.21 ms for the RMS
#: forms at 16x1024. lort leaves them out of groups that run on CPU.
SKIP_NORM_FUSIONS = ("fuse_skip_layer_normalization", "fuse_skip_rms_normalization")


def _no_fusion(model, debug: bool = False, **kwargs) -> int:
    return 0


def _quadratic_rules() -> tuple:
    """Rules of onnxscript's default rewrite set left out of optimize_for_ort's optimizer
    runs: SlicesSplit (two Slices of one tensor's halves -> one Split) has two output
    nodes, and onnxscript matches such a pattern by scanning the whole graph for each
    candidate node, so its cost grows with the square of the group's size: the rewrites
    of a 12-layer Llama-style decoder's group (1700 nodes) took 6.5-7.0 s with it and
    2.7 s without, and gave the same graph op for op (the rotary embedding fusion takes
    those Slices first). Where it would fire, it only puts one Split in place of two
    Slices."""
    from onnxscript.rewriter.rules.common import _basic_rules

    rule = getattr(_basic_rules, "slice_split_rule", None)
    return (rule,) if rule is not None else ()


def _exact_no_op_rules() -> None:
    """onnxscript's optimizer (run by optimize_for_ort) removes ``x + c``, ``x - c``,
    ``x * c`` and ``x / c`` as no-ops when ``c`` is close to 0 or 1 by its pattern
    constants' default tolerances (abs 1e-8, rel 1e-5): ``x + 1e-8`` (an epsilon before a
    division, a log or a sqrt) became ``x``, 0 where PyTorch gives 1e-8. Those constants
    are made exact (once; idempotent): only a true 0 or 1 is a no-op."""
    from onnxscript import rewriter
    from onnxscript.rewriter import _pattern_ir

    for rule in rewriter._DEFAULT_REWRITE_RULES:
        for node in rule._target_pattern:
            for value in node.inputs:
                if isinstance(value, _pattern_ir.Constant):
                    value._rel_tol = value._abs_tol = 0.0


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


def fuse_across_cuts(model: ir.Model, skip_norms: bool = True) -> dict[str, int]:
    """onnxscript's fusions that can span the cuts of a model stitched from layers
    rewritten one by one (translate/repeated.py), applied in place; the counts of each.
    The rotary embedding's angles come into every layer from before the first, so its
    fusion to ONNX's RotaryEmbedding (_onnx_fusions, opset 23 only) needs the stitched
    model. With ``skip_norms`` (not on CPU: optimize_for_ort), a residual Add ending one
    layer with the norm starting the next becomes ORT's SkipLayerNormalization or
    SkipSimplifiedLayerNormalization, as in a group rewritten whole (ORT's own optimizer
    fused none of them on GPT-2 small's decode)."""
    counts = _onnx_fusions(model)
    if not skip_norms:
        return counts
    from onnxscript.rewriter.ort_fusions.skip_normalization import (
        fuse_skip_layer_normalization,
        fuse_skip_rms_normalization,
    )

    return {
        **counts,
        "skip_layer_normalization": fuse_skip_layer_normalization(model),
        "skip_rms_normalization": fuse_skip_rms_normalization(model),
    }


def node_cloner(value_map: dict) -> Any:
    """onnx_ir's cloner of nodes (private in onnx-ir 1.1): ``clone_node(node)`` copies a
    node (its subgraphs too) reading its inputs through ``value_map`` (old value -> new
    value), which it extends with the copy's outputs."""
    from onnx_ir._cloner import Cloner

    return Cloner(attr_map={}, value_map=value_map, metadata_props={})


def translate_graph(fx_graph: torch.fx.Graph, name: str, reg: Any) -> ir.Model:
    """Translate an FX graph of ATen ops (placeholders, call_function, output) to ONNX IR.

    ``reg``: the registry of translations (translate/registry.py). Placeholders become graph inputs in order; the output node's values become graph
    outputs in order. Shapes and dtypes come from each node's ``meta["val"]``.
    """
    check_versions()
    model = ir.Model(
        graph=ir.Graph([], [], nodes=[], name=name),
        ir_version=IR_VERSION,
        producer_name="lort",
        producer_version=__version__,
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
            registry=reg,
        )
    finally:
        core_logger.setLevel(level)
    _ex_ir_passes.add_opset_imports(model)
    return model

