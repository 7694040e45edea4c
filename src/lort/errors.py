"""Typed errors raised by lort. All derive from LortError."""

from __future__ import annotations


class LortError(RuntimeError):
    """Base class of every error lort raises on purpose."""


class UnsupportedVersionError(LortError):
    """The installed torch / onnxscript / onnxruntime lacks what lort needs."""


class UnsupportedInputError(LortError, ValueError):
    """An input lort cannot run (dtype, device, structure); the message says what to do."""


class QuantizationError(UnsupportedInputError):
    """Options.quantize asked for what it does not cover (training, a CUDA graph). Never
    a reason to fall back: lort.ORTModule raises it too, not running the module in
    PyTorch with float32 weights."""


class TranslationError(LortError):
    """A fusion group could not be translated to ONNX."""


class SessionCreationError(LortError):
    """ONNX Runtime refused to build a session for a translated group."""


class SessionRunError(SessionCreationError):
    """ORT built a group's session but failed to run it (fallback policy 'raise'; with
    'warn' the group runs in PyTorch from then on). A SessionCreationError, so code that
    handles a session ORT refused handles this too."""


class MismatchError(LortError, AssertionError):
    """In debug mode, a group's ORT outputs differ from PyTorch's beyond tolerance."""

    def __init__(self, group: str, output: int, max_abs: float, max_rel: float, rtol: float, atol: float):
        self.group = group
        self.output = output
        self.max_abs = max_abs
        self.max_rel = max_rel
        super().__init__(
            f"lort debug mode: group {group!r} output {output} differs from PyTorch: "
            f"max abs error {max_abs:.3g}, max rel error {max_rel:.3g} "
            f"(rtol={rtol:g}, atol={atol:g}). Run with mode='pytorch' to bisect, or "
            f"raise the tolerances with LORT_RELATIVE_TOLERANCE / LORT_ABSOLUTE_TOLERANCE."
        )


class CaptureError(LortError):
    """lort.ORTModule could not capture or compile a module (fallback policy 'raise')."""


class OpaqueFunctionError(LortError):
    """An autograd.Function run opaquely misbehaved (e.g. its outputs at run time differ
    from those seen at capture time)."""


def one_line(error: BaseException, limit: int = 300) -> str:
    """``error`` as one line for a log or a report: its type and its message's first line
    (at most ``limit`` characters)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:limit] if text else ''}"
