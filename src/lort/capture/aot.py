"""AOTAutograd wiring: Dynamo graph -> forward and backward (or inference) ATen graphs.

Ops that torch_lib cannot translate are decomposed by PyTorch's own decompositions
(e.g. ``native_layer_norm_backward``, ``gelu_backward`` become elementwise and
reduction ops ORT runs), so backward graphs stay in few, large ORT groups. Ops torch_lib
translates directly are kept whole.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel



def aot_backend(compile_graph: Callable[[torch.fx.GraphModule, list, str], Callable], decomps: dict) -> Callable:
    """A Dynamo backend that hands AOTAutograd's graphs to ``compile_graph(gm, inputs, kind)``,
    kind being 'forward', 'backward' or 'inference'; ``decomps`` is the table from
    ``decompositions.table``."""
    from torch._dynamo.backends.common import aot_autograd

    def fw(gm, example_inputs):
        return compile_graph(gm, example_inputs, "forward")

    def bw(gm, example_inputs):
        return compile_graph(gm, example_inputs, "backward")

    def inference(gm, example_inputs):
        return compile_graph(gm, example_inputs, "inference")

    inner = aot_autograd(
        fw_compiler=fw,
        bw_compiler=bw,
        inference_compiler=inference,
        decompositions=decomps,
        # Buffer updates (batch norm's running stats) leave the graph as outputs and
        # AOTAutograd's epilogue writes them, so graphs stay functional.
        keep_inference_input_mutations=False,
    )

    def backend(gm, example_inputs):
        if _cpu_float32_inference(example_inputs):
            # PyTorch's CPU attention kernel stays whole: lort runs it as ONNX's
            # Attention, one node (translate/attention.py).
            return inner(gm, example_inputs)
        # Attention traced in its math form: its backward is then matmuls and softmax,
        # which ORT runs, instead of the fused CPU kernel's backward, which it cannot
        # (and CUDA's attention kernels stay PyTorch's decision, not traced here).
        with sdpa_kernel([SDPBackend.MATH]):
            return inner(gm, example_inputs)

    return backend


def _cpu_float32_inference(example_inputs: list) -> bool:
    """Whether AOTAutograd makes an inference graph of these inputs (no gradient) whose
    tensors are all on the CPU, the floating ones float32."""
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return all(t.device.type == "cpu" and (t.dtype == torch.float32 or not t.dtype.is_floating_point)
               for t in tensors)
