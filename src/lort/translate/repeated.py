"""A group that repeats one layer, translated and rewritten once per distinct layer.

A transformer's group holds N copies of one layer's subgraph; translating and rewriting
each copy as new made lort's first call grow with N (BERT-base's 12 layers, a decoder's
16). ``split`` cuts a group's nodes, in graph order, into runs of one layer each: the
outermost numbered module (``layer.3``, ``layers.11``) in a node's ``nn_module_stack``
(``fwd_nn_module_stack`` for a backward node; a node with neither stays in the run it
follows). Runs of the same structure (ops, arguments, dtypes and shapes, in order) share
one translation and one set of onnxscript's rewrites, and ``stitch`` puts the copies
back into one model: the group keeps one session and pays nothing per call.

Any cut of a topologically ordered node list into consecutive runs is a valid
partition (a run reads only the group's inputs and earlier runs), so the layer labels
decide only how much is shared, never what is computed. What a run-wise rewrite cannot
see is a fusion across a cut (a residual Add ending one layer with the norm starting
the next); ORT's own optimizer, which sees the stitched graph, fuses those.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import re

import onnx_ir as ir
import torch
import torch.fx
from onnx_ir import tensor_adapters
from onnx_ir.passes.common import NameFixPass

from . import _compat

#: A group smaller than this is translated whole: splitting saves less than it costs.
MIN_NODES = 150

_NUMBERED = re.compile(r"(\.\d+|\[\d+\])$")


@dataclasses.dataclass
class Run:
    """A run of the group's nodes as a graph of its own: ``inputs`` are the group's
    values it reads (placeholders or earlier runs' nodes), ``outputs`` those of its own
    that later runs or the group's output read, in the graph's order."""

    gm: torch.fx.GraphModule
    key: str
    inputs: list[torch.fx.Node]
    outputs: list[torch.fx.Node]


def split(gm: torch.fx.GraphModule) -> list[Run] | None:
    """The group's runs, or None where it is small or has no numbered layer. (A run
    that repeats none in its own group may repeat one of another group of the graph:
    ``onnx_export.shared_runs``.)"""
    nodes = _ordered(gm)
    if len(nodes) < MIN_NODES or any(n.op not in ("placeholder", "call_function", "output") for n in gm.graph.nodes):
        return None
    labels, current = {}, None
    for n in nodes:
        label = _layer(n) if n.target is not operator.getitem else labels[n.args[0]]
        current = label if label is not None else current
        labels[n] = current
    runs, start = [], 0
    for i in range(1, len(nodes) + 1):
        if i == len(nodes) or labels[nodes[i]] != labels[nodes[start]]:
            runs.append(nodes[start:i])
            start = i
    if len(runs) < 2 and labels[nodes[0]] is None:
        return None
    return [_run(gm, r) for r in runs]


def _ordered(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The group's computing nodes in graph order, each getitem moved right after the
    node it reads (a multi-output node never has its tuple cross a cut)."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        out.append(n)
        out.extend(u for u in n.users if u.op == "call_function" and u.target is operator.getitem)
    return out


def _layer(node: torch.fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    for entry in stack.values():
        path = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(path, str) and _NUMBERED.search(path):
            return path
    return None


def _run(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> Run:
    inside = set(nodes)
    inputs: dict[torch.fx.Node, None] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside:
                inputs.setdefault(a, None)
    # A multi-output node's users are its getitems, which follow it into its run.
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    g = torch.fx.Graph()
    env = {}
    for i, a in enumerate(inputs):
        ph = g.placeholder(f"in_{i}")
        ph.meta = {"val": a.meta.get("val")}
        env[a] = ph
    for n in nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[n] for n in outputs))
    run_gm = torch.fx.GraphModule(gm, g)
    return Run(run_gm, structure(g), list(inputs), outputs)


def structure(g: torch.fx.Graph) -> str:
    """A digest of what translation reads: each node's op, its arguments (other nodes
    by position) and its value's dtype, shape and strides. Two graphs of one digest
    translate to one model (up to names) and run alike."""
    index = {n: i for i, n in enumerate(g.nodes)}

    def arg(a):
        return torch.fx.node.map_arg(a, lambda n: f"%{index[n]}")

    lines = [f"{n.op} {n.target if n.op != 'placeholder' else ''} {arg(n.args)!r} {arg(n.kwargs)!r} {describe_value(n.meta.get('val'))}"
             for n in g.nodes]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def describe_value(val) -> str:
    """A node value as keys read it: a tensor's dtype, shape, strides and device type
    (symbolic sizes by name), a tuple's items, else the type's name."""
    if isinstance(val, torch.Tensor):
        return f"{val.dtype}{tuple(str(d) for d in val.shape)}{tuple(str(s) for s in val.stride())}{val.device.type}"
    if isinstance(val, (list, tuple)):
        return "(" + ",".join(describe_value(v) for v in val) + ")"
    return type(val).__name__


def input_value(node: torch.fx.Node) -> ir.Value:
    """A graph input of ONNX type for the group's placeholder ``node``."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        dims = [int(s) if isinstance(s, int) else str(s) for s in val.shape]
        return ir.Value(type=ir.TensorType(tensor_adapters.from_torch_dtype(val.dtype)), shape=ir.Shape(dims))
    if isinstance(val, torch.SymFloat) or isinstance(val, float):
        return ir.Value(type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]))
    if isinstance(val, torch.SymBool) or isinstance(val, bool):
        return ir.Value(type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    return ir.Value(type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))


def stitch(name: str, gm: torch.fx.GraphModule, runs: list[Run], models: list[ir.Model]) -> ir.Model:
    """One model computing the group from its runs' models (``models[i]`` computes
    ``runs[i]``; runs of one structure may share one model object, which is not
    changed). Inputs are the group's placeholders, outputs its output's values; each
    copy's values get names of their own."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # Each input typed as the first run reading it typed it (else from its meta).
    typed: dict[torch.fx.Node, ir.Value] = {}
    for run, model in zip(runs, models):
        for v, a in zip(model.graph.inputs, run.inputs):
            if a.op == "placeholder" and a not in typed:
                typed[a] = ir.Value(type=v.type, shape=v.shape.copy() if v.shape is not None else None)
    inputs = [typed.get(p) or input_value(p) for p in placeholders]
    values: dict[torch.fx.Node, ir.Value] = dict(zip(placeholders, inputs))
    graph = ir.Graph(inputs, [], nodes=[], name=name)
    opsets: dict[str, int] = {}
    functions: dict = {}
    for k, (run, model) in enumerate(zip(runs, models)):
        sub = model.graph
        value_map = {v: values[a] for v, a in zip(sub.inputs, run.inputs)}
        for init in sub.initializers.values():
            shape = init.shape.copy() if init.shape is not None else None
            copy = ir.Value(name=f"r{k}.{init.name}", type=init.type, shape=shape, const_value=init.const_value)
            graph.register_initializer(copy)
            value_map[init] = copy
        cloner = _compat.node_cloner(value_map)
        for node in sub:
            graph.append(cloner.clone_node(node))
        for v, n in zip(sub.outputs, run.outputs):
            values[n] = value_map[v]
        for domain, version in model.opset_imports.items():
            opsets[domain] = max(opsets.get(domain, version), version)
        functions.update(model.functions)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    graph.outputs.extend(values[n] for n in out.args[0])
    stitched = ir.Model(graph, ir_version=models[0].ir_version, producer_name=models[0].producer_name,
                        producer_version=models[0].producer_version, functions=list(functions.values()))
    graph.opset_imports.update(opsets)
    return stitched


def fix_names(model: ir.Model) -> None:
    """Unique names for every value and node (the copies of one run share theirs)."""
    NameFixPass()(model)
