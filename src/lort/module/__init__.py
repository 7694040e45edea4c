"""lort.ORTModule: a drop-in for onnxruntime's ORTModule, with graph transition management."""

from .ortmodule import DebugOptions, LogLevel, ORTModule
from .transition import TransitionManager

__all__ = ["DebugOptions", "LogLevel", "ORTModule", "TransitionManager"]
