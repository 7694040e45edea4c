"""Why nodes of the OpInfo conformance sweep (lort.testing.conformance) stayed in
PyTorch: the tables' label of each lort reason, by its kind or, for a reason saved as a
plain string, by a pattern over its text."""

from __future__ import annotations

import re

from ..reasons import Reason, ReasonKind

#: Kinds of reasons for a node to stay in PyTorch: (kind, regex over lort's reason).
#: Reasons come from lort/fusion/support.py, lort/backend.py and the known-wrong table.
FALLBACK_KINDS = (
    ("no torch_lib translation", r"^no torch_lib translation registered"),
    ("random op", r"^random op"),
    ("mutates an input", r"^mutates an input"),
    ("non-tensor output", r"^output is not a tensor"),
    ("unsupported dtype", r"has dtype .* which lort does not send to ORT"),
    ("non-tensor argument", r"^argument .* is (a|an) \w+ constant|^argument .* not a tensor or int/float scalar"),
    ("not an ATen op", r"is not an ATen operator"),
    ("translation failed", r"^translation failed"),
    ("group failed", r"^its group failed as a whole"),
    ("views only", r"^left alone by the fuser"),
    ("ran in PyTorch at run time", r"runs in PyTorch"),
    ("device", r"device"),
    ("no matching torch_lib overload", r"(?i)overload|dispatch|not supported|could not|no .*match"),
    ("ORT has no kernel for the dtype", r"^ORT's \w+ has no \w+ kernel for"),
    ("float64 scalar float32 would round", r"^float64 graph: the translation makes its float argument"),
    ("known wrong (_known_wrong)", r"torch_lib|ORT|ONNX"),
)


#: The table's label of each ReasonKind (lort.reasons).
KIND_LABELS = {
    ReasonKind.NO_TRANSLATION: "no torch_lib translation",
    ReasonKind.RANDOM: "random op",
    ReasonKind.MUTATION: "mutates an input",
    ReasonKind.ARGUMENT: "non-tensor argument or output",
    ReasonKind.DTYPE: "unsupported dtype",
    ReasonKind.NO_KERNEL: "ORT has no kernel for the dtype",
    ReasonKind.NOT_ATEN: "not an ATen op",
    ReasonKind.TRANSLATION_FAILED: "translation failed",
    ReasonKind.GROUP_FAILED: "group failed",
    ReasonKind.LEFT_ALONE: "views only",
    ReasonKind.VIEW_OF_INPUT: "views only",
    ReasonKind.RUN_FAILED: "ran in PyTorch at run time",
    ReasonKind.DEVICE: "device",
    ReasonKind.KNOWN_WRONG: "known wrong (fusion/known_wrong.py)",
    ReasonKind.SLOWER_IN_ORT: "timed faster in PyTorch",
    ReasonKind.GRAPH_FASTER_IN_EAGER: "timed faster in PyTorch",
}


def fallback_kind(reason: str) -> str:
    """The table's label of a reason: by its kind (a lort Reason); a plain string (from
    a saved result) by the patterns of FALLBACK_KINDS."""
    if isinstance(reason, Reason):
        return KIND_LABELS.get(reason.kind, "other")
    for kind, pattern in FALLBACK_KINDS:
        if re.search(pattern, reason):
            return kind
    return "other"
