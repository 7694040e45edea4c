"""Inductor with frozen weights as lort's inductor engine for inference graphs: what it is
worth, and what stands in the way.

lort's ORT engine freezes an inference graph's weights (Options.freeze: initializers ORT
folds and pre-packs), but its inductor engine (compile/engines.py) compiles the Dynamo
graph with the weights as inputs, as ``torch.compile``'s default does. Inductor has a
frozen mode too (``torch._inductor.config.freezing``: weights as constants, folded, and
with ``cpp.weight_prepack`` packed for oneDNN's convolutions and MKL's linear layers).
This study times, for each model at batch 8 under ``no_grad`` (random weights), each
variant in a fresh process, interleaved there with eager PyTorch on the same inputs:

- ``compile``: ``torch.compile(model)`` (inductor's defaults);
- ``compile_freezing``: the same with ``freezing=True`` (weights packed too);
- ``lort``: lort's inductor compile (``inductor_compat.start`` on the Dynamo graph, its
  code generation in inductor's subprocess), as executor="auto" times it;
- ``lort_frozen``: the same with the graph's weights turned into the module's own
  attributes (so AOTAutograd lifts them as parameters and inductor freezes them) and
  ``freezing=True``, ``cpp.weight_prepack=False``: a packed weight (an MKLDNN opaque
  tensor) cannot be pickled to inductor's subprocess.

Each row: first-call seconds (the compile; for lort's, until its subprocess is done), the
variant's median ms and eager's in the same process, and the largest difference from
eager's output. The table goes between the file's ``<!-- inductor_freezing -->`` markers;
the reading after them is kept.

    python benchmarks/studies/inductor_freezing.py [--models vit_small,bert_base,resnet50] [--calls 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import operator
import statistics
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from report import machine, write_section  # noqa: E402
from timing import timed_interleaved  # noqa: E402

VARIANTS = ["compile", "compile_freezing", "lort", "lort_frozen"]


def _lifted(gm, example_inputs, weights):
    """``gm`` with the placeholders at ``weights`` read as attributes of its own (buffers
    and parameters AOTAutograd lifts), and the other inputs."""
    import torch

    graph = copy.deepcopy(gm.graph)
    root = {n.target: operator.attrgetter(n.target)(gm) for n in graph.nodes if n.op == "get_attr"}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for i in sorted(weights):
        name = f"_frozen_{i}"
        root[name] = example_inputs[i]
        with graph.inserting_after(placeholders[-1]):
            attr = graph.get_attr(name)
        attr.meta = dict(placeholders[i].meta)
        placeholders[i].replace_all_uses_with(attr)
        graph.erase_node(placeholders[i])
    return torch.fx.GraphModule(root, graph), [a for i, a in enumerate(example_inputs) if i not in weights]


def child(model_name: str, variant: str, calls: int) -> dict:
    import torch

    from lort.testing.models import ENGINE_CASES, make_torchvision_importable, output_tensor

    make_torchvision_importable()
    from lort.capture.weights import module_weights
    from lort.compile import inductor_compat

    torch.manual_seed(0)
    model, args, kwargs = ENGINE_CASES[model_name](8)
    model.eval()
    with torch.no_grad():
        want = output_tensor(model(*args, **kwargs))
        start = time.perf_counter()
        if variant.startswith("compile"):
            with torch._inductor.config.patch(freezing=variant == "compile_freezing"):
                compiled = torch.compile(model)
                got = output_tensor(compiled(*args, **kwargs))
            call = lambda: compiled(*args, **kwargs)  # noqa: E731
        else:
            graphs = []

            def capture(gm, example_inputs):
                graphs.append((gm, example_inputs, module_weights(gm, example_inputs)))
                return gm.forward

            torch.compile(model, backend=capture)(*args, **kwargs)
            assert len(graphs) == 1, f"{len(graphs)} graphs"
            gm, inputs, weights = graphs[0]
            want = gm(*inputs)[0]  # the graph's first output, in eager
            patch = {"freezing": False}
            if variant == "lort_frozen":
                gm, inputs = _lifted(gm, inputs, weights)
                patch = {"freezing": True, "cpp.weight_prepack": False}
            with torch._inductor.config.patch(patch):
                job = inductor_compat.start(gm, inputs)
            while not job.ready():
                time.sleep(0.05)
            fn = job.result()
            got = fn(*inputs)[0]
            call = lambda: fn(*inputs)  # noqa: E731
        first = time.perf_counter() - start
        # One call a sample (min_time 0), eager and the variant taking turns.
        t = timed_interleaved({"eager": lambda: model(*args, **kwargs), "variant": call}, min_time=0.0,
                              repeats=calls)
    return {"first_s": first, "ms": t["variant"] * 1e3, "eager_ms": t["eager"] * 1e3,
            "max_abs": float((got - want).abs().max())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="vit_small,bert_base,resnet50")
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(HERE, "inductor_freezing.md"))
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], int(a.child[2]))))
        return
    lines = [
        f"Taken {datetime.date.today()} by `python benchmarks/studies/inductor_freezing.py --models {a.models} "
        f"--calls {a.calls} --rounds {a.rounds}`.",
        f"Machine: {machine()}. Batch 8, no_grad, random weights; each variant in a fresh process, timed "
        "interleaved with eager there (median of the calls); the variants take turns for the rounds. ms, "
        "eager ms, first s: medians over rounds; vs eager: the median over rounds of eager's time over the "
        "variant's in the same process (range); vs `compile`: that against `compile`'s.",
        "",
        "| model | variant | first s | ms | eager ms there | vs eager (range) | vs `compile` | largest difference from eager |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model in a.models.split(","):
        runs: dict = {v: [] for v in VARIANTS}
        errors: dict = {}
        for _ in range(a.rounds):  # the variants take turns, each run a fresh process
            for variant in VARIANTS:
                if variant in errors:
                    continue
                out = subprocess.run([sys.executable, __file__, "--child", model, variant, str(a.calls)],
                                     capture_output=True, text=True)
                if out.returncode != 0:
                    errors[variant] = (out.stderr.strip().splitlines() or ["?"])[-1][:160]
                    continue
                runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))

        def med(variant, key):
            return statistics.median(r[key] for r in runs[variant])

        # Speed as eager's time over the variant's in each process (a 2-core VM drifts
        # between processes more than within one), then the median over rounds.
        speed = {v: statistics.median(r["eager_ms"] / r["ms"] for r in rs) for v, rs in runs.items() if rs}
        for variant in VARIANTS:
            if variant in errors:
                lines.append(f"| {model} | {variant} | failed: {errors[variant]} | | | | | |")
                continue
            ratios = [r["eager_ms"] / r["ms"] for r in runs[variant]]
            vs_compile = f"{speed[variant] / speed['compile']:.2f}x" if "compile" in speed else "-"
            lines.append(f"| {model} | {variant} | {med(variant, 'first_s'):.1f} | {med(variant, 'ms'):.1f} | "
                         f"{med(variant, 'eager_ms'):.1f} | {speed[variant]:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) "
                         f"| {vs_compile} | {max(r['max_abs'] for r in runs[variant]):.1e} |")
        print("\n".join(lines[-len(VARIANTS):]), flush=True)
    write_section(a.out, "inductor_freezing", lines, title="# Inductor with frozen weights as lort's inductor engine\n")


if __name__ == "__main__":
    main()
