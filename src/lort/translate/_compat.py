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
from typing import Any, Callable

import torch

from ..errors import UnsupportedVersionError

try:  # pragma: no cover - exercised by the import itself
    import onnx_ir as ir
    from torch.onnx._internal.exporter import _constants as _ex_constants
    from torch.onnx._internal.exporter import _core as _ex_core
    from torch.onnx._internal.exporter import _decomp as _ex_decomp
    from torch.onnx._internal.exporter import _dispatching as _ex_dispatching
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
    return _ex_registration.ONNXRegistry.from_torchlib(OPSET)


def _known_wrong() -> dict:
    """torch_lib translations that give results different from PyTorch's, found by
    lort's op tests. They are treated as untranslatable, so PyTorch's decomposition of
    the op (into ops that translate correctly) is used instead."""
    aten = torch.ops.aten
    return {
        aten._native_batch_norm_legit_functional.default: (
            "torch_lib's training-mode batch norm (ONNX BatchNormalization training_mode=1) "
            "differs from PyTorch's outputs; decomposed instead"
        ),
    }


def dispatch(node: torch.fx.Node) -> tuple[Callable | None, str]:
    """The torch_lib function that translates ``node``, or None and the reason."""
    reg = registry()
    wrong = _known_wrong().get(node.target)
    if wrong:
        return None, wrong
    if not reg.is_registered(node.target):
        return None, "no torch_lib translation registered"
    return _ex_dispatching.dispatch(node, reg)


@functools.lru_cache(maxsize=1)
def decomposition_table() -> dict:
    """PyTorch decompositions for exactly the ops torch_lib cannot translate (correctly)."""
    reg = registry()
    implemented = set(_ex_decomp.get_onnx_implemented_overloads(reg)) - set(_known_wrong())
    return _ex_decomp.create_onnx_friendly_decomposition_table(implemented)


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
