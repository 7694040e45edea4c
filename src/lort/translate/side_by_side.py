"""Several ONNX models as one, side by side: what ORTModule's debug files hold where
lort runs a graph as several groups (module/transition.py writes them)."""

from __future__ import annotations

import onnx
from onnx import compose, helper


def side_by_side(models: list[bytes], name: str) -> onnx.ModelProto:
    """One model holding ``models`` (serialized ONNX models) side by side: model ``i``'s
    names (values, nodes, initializers, functions) prefixed ``g{i}_``; its inputs and
    outputs are the merged model's, in order; each opset domain at its highest version."""
    graph = helper.make_graph([], name, [], [])
    opsets: dict[str, int] = {}
    functions = []
    ir_version = 0
    for i, data in enumerate(models):
        model = compose.add_prefix(onnx.ModelProto.FromString(data), f"g{i}_")
        g = model.graph
        graph.node.extend(g.node)
        graph.input.extend(g.input)
        graph.output.extend(g.output)
        graph.initializer.extend(g.initializer)
        graph.sparse_initializer.extend(g.sparse_initializer)
        graph.value_info.extend(g.value_info)
        for o in model.opset_import:
            opsets[o.domain] = max(opsets.get(o.domain, 0), o.version)
        functions.extend(model.functions)
        ir_version = max(ir_version, model.ir_version)
    merged = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets.items())],
                               functions=functions, producer_name="lort")
    merged.ir_version = ir_version or merged.ir_version
    return merged
