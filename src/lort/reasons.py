"""Why a node, group or graph runs where it does: typed reasons and one placement vocabulary.

A ``Reason`` is a value with a ``kind`` (``ReasonKind``) and a ``detail`` text. It is
also a ``str`` (its text), so reports, warnings and ``ExplainReport.fallbacks`` show it
as before; code that decides anything (warnings, the disk cache, explain) reads
``reason.kind``, never the text.
"""

from __future__ import annotations

import enum


class Placement(str, enum.Enum):
    """Where a group or a whole graph runs. For a graph, ``ORT`` means through lort's
    compiled graph (its groups in ORT, the rest in PyTorch); ``PYTORCH`` means eager
    PyTorch; ``INDUCTOR`` means compiled by inductor (compile/engines.py). A ``str`` so
    that ``placement == "ort"`` holds."""

    ORT = "ort"
    PYTORCH = "pytorch"
    INDUCTOR = "inductor"

    def __str__(self) -> str:
        return self.value


class ReasonKind(enum.Enum):
    """The kinds of reason for something to stay in PyTorch."""

    #: Not an ATen operator call (a placeholder, a Python function, getitem on a non-tuple).
    NOT_ATEN = "not an ATen operator"
    #: torch_lib has no translation for the operator (or for its arguments).
    NO_TRANSLATION = "no translation"
    #: A dtype lort does not send to ORT.
    DTYPE = "dtype"
    #: ORT has no kernel for the op's translation in this dtype.
    NO_KERNEL = "no ORT kernel for the dtype"
    #: A device without an ORT execution provider, or mixed devices.
    DEVICE = "device"
    #: A non-dense layout, or an argument that is not a tensor or scalar.
    ARGUMENT = "argument"
    #: Mutates an input (ORT groups are functional).
    MUTATION = "mutation"
    #: A random op (results follow PyTorch's RNG).
    RANDOM = "random"
    #: torch_lib's translation gives a wrong result for these arguments.
    KNOWN_WRONG = "known-wrong translation"
    #: Translating the node (alone) failed, or ORT refused its session.
    TRANSLATION_FAILED = "translation failed"
    #: The node's group failed to translate or build a session as a whole.
    GROUP_FAILED = "group failed"
    #: ORT failed to run the node's group at run time.
    RUN_FAILED = "run failed"
    #: executor="auto" timed the node's group faster in PyTorch.
    SLOWER_IN_ORT = "slower in ORT"
    #: executor="auto" timed the node's whole graph faster in eager PyTorch.
    GRAPH_FASTER_IN_EAGER = "graph faster in eager"
    #: executor="auto" timed the node's whole graph faster compiled by inductor.
    GRAPH_FASTER_IN_INDUCTOR = "graph faster in inductor"
    #: The fuser left the node alone (a group of views only, or over max_group_args alone).
    LEFT_ALONE = "left alone by the fuser"
    #: A view of the graph's input that leaves the graph or feeds PyTorch: free in
    #: PyTorch, a copy out of ORT (fusion/input_views.py).
    VIEW_OF_INPUT = "view of an input"

    @property
    def found_by_translating(self) -> bool:
        """Found by building ORT sessions, not by the support check: warned about."""
        return self in (ReasonKind.TRANSLATION_FAILED, ReasonKind.GROUP_FAILED)


class Reason(str):
    """A reason: its text (``str(reason)``, ``reason.detail``) and its ``kind``."""

    kind: ReasonKind
    detail: str

    def __new__(cls, kind: ReasonKind, detail: str) -> "Reason":
        if not isinstance(kind, ReasonKind):
            raise TypeError(f"Reason kind must be a ReasonKind, not {kind!r}")
        obj = super().__new__(cls, detail)
        obj.kind = kind
        obj.detail = detail
        return obj

    def __reduce__(self):
        return (Reason, (self.kind, self.detail))

    def __repr__(self) -> str:
        return f"Reason({self.kind.name}, {self.detail!r})"

    def to_json(self) -> dict:
        return {"kind": self.kind.name, "detail": self.detail}

    @staticmethod
    def from_json(data) -> "Reason | None":
        """The reason stored by ``to_json``, or None if ``data`` is not one."""
        if not isinstance(data, dict) or not isinstance(data.get("detail"), str):
            return None
        kind = ReasonKind.__members__.get(data.get("kind"))
        return None if kind is None else Reason(kind, data["detail"])
