"""Capture: AOTAutograd forward/backward ATen graphs, decomposed for ORT."""

from .aot import aot_backend

__all__ = ["aot_backend"]
