"""Translate: FX fusion groups -> ONNX through onnxscript's torch_lib."""
