"""Capture: AOTAutograd forward/backward ATen graphs, decomposed for ORT."""

from .aot import decompositions, aot_backend

__all__ = ["decompositions", "aot_backend"]
