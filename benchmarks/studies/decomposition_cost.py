"""Cost of a set of lort's decompositions on the benchmark models that have their ops:
each model compiled by lort with executor='ort' (every group in ORT) with and without
them, timed interleaved in one process (without/with, 25 rounds), one thread for PyTorch
and ORT. Times are process CPU time per call (the median, then the minimum), which a
machine shared with other work disturbs less than wall time.

    python benchmarks/studies/decomposition_cost.py [--set nan|logistic] [model:scenario ...]

Sets: ``nan``, the NaN decompositions (src/lort/capture/decompositions/__init__.py; max_pool in the
CNN and the ResNets; default configurations below); ``logistic``, sigmoid / silu /
silu_backward as ``1 / (1 + exp(-x))`` on CPU (src/lort/capture/decompositions/exponential.py;
SiLU in llama, and ``silu``, the op alone on a (batch, 128, 4096) tensor; default
configurations ``LOGISTIC_DEFAULT``).

Scenarios ``ortmodule1`` and ``ortmodule8`` time ``lort.ORTModule`` inference instead (batch
1 / 8, lort's default threads: the direct-inference lane over one frozen ORT session), in
wall time, with torch's default threads.

Prints markdown rows for benchmarks/studies/nan_semantics.md and benchmarks/studies/logistic_cost.md.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import lort
from lort.capture import decompositions, export
from lort.capture.decompositions import exponential as decompositions_exponential
from lort.testing.models import CASES, make_torchvision_importable, output_tensor

make_torchvision_importable()

DEFAULT = ["cnn:infer1", "cnn:train", "resnet18:infer1", "resnet18:train", "resnet50:infer1"]
LOGISTIC_DEFAULT = ["efficientnet:infer1", "efficientnet:infer8", "efficientnet:ortmodule1", "efficientnet:ortmodule8",
                    "efficientnet:train", "mobilevit:ortmodule1", "mobilevit:ortmodule8",
                    "llama:infer1", "llama:infer8", "llama:train", "llama:ortmodule1", "llama:ortmodule8",
                    "silu:infer1", "silu:infer8", "silu:train"]
ROUNDS = 25

_REAL_NAN = decompositions.nan.nan_decompositions
_REAL_EXPONENTIAL = decompositions_exponential.table
_LOGISTIC = (torch.ops.aten.sigmoid.default, torch.ops.aten.silu.default, torch.ops.aten.silu_backward.default)


def _silu_backward_formula(grad, x):
    return decompositions_exponential.silu_backward_over(grad, x, decompositions_exponential.sigmoid(x))


#: Eager's formulas on every device (what lort used on CPU before the precision policy).
_FORMULAS = (decompositions_exponential.sigmoid, decompositions_exponential.silu, _silu_backward_formula)


def use(which: str, on: bool) -> None:
    """Turn the set ``which`` of decompositions on or off (the other set stays on)."""
    decompositions.nan.nan_decompositions = _REAL_NAN if on or which != "nan" else (lambda: {})
    if on and which == "logistic":
        decompositions_exponential.table = lambda: {**_REAL_EXPONENTIAL(), **dict(zip(_LOGISTIC, _FORMULAS))}
    else:
        decompositions_exponential.table = _REAL_EXPONENTIAL
    decompositions.table.cache_clear()
    export.decomposition_table.cache_clear()


def _make(name: str, batch: int):
    """A benchmark model, or ``silu`` alone on a (batch, 128, 4096) float32 tensor (the
    decomposition's cost where the op is all there is)."""
    if name == "silu":
        torch.manual_seed(0)
        return torch.nn.SiLU(), (torch.randn(batch, 128, 4096).requires_grad_(),)
    return CASES[name].make(batch, seed=0)


def build(name: str, scenario: str, which: str, on: bool):
    use(which, on)
    torch._dynamo.reset()
    if scenario.startswith("ortmodule"):
        model, args = _make(name, int(scenario[len("ortmodule"):]))
        om = lort.ORTModule(model.eval(), options=lort.Options(executor="ort", disk_cache=False))

        def step():
            with torch.no_grad():
                om(*args)

        step()
        return step, sum(r.ort_nodes for r in om.transition_manager.records)
    model, args = _make(name, 1 if scenario == "infer1" else 8)
    backend = lort.LortBackend({"executor": "ort", "disk_cache": False, "intra_op_num_threads": 1})
    fn = torch.compile(model, backend=backend)
    if scenario.startswith("infer"):
        model.eval()

        def step():
            with torch.no_grad():
                fn(*args)
    else:

        def step():
            for p in [*model.parameters(), *args]:
                p.grad = None
            output_tensor(fn(*args)).float().pow(2).mean().backward()

    step()
    nodes = sum(r.ort_nodes for r in backend.records)
    return step, nodes


def main(argv: list[str]) -> None:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    which = "nan"
    if argv[:1] == ["--set"]:
        which, argv = argv[1], argv[2:]
    if which not in ("nan", "logistic"):
        raise SystemExit(f"--set must be nan or logistic, not {which!r}")
    threads = torch.get_num_threads()
    print("| model | run | without ms | with ms | with / without | without min ms | with min ms | ATen nodes in ORT without / with |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for config in argv or (DEFAULT if which == "nan" else LOGISTIC_DEFAULT):
        name, scenario = config.split(":")
        wall = scenario.startswith("ortmodule")
        torch.set_num_threads(threads if wall else 1)
        clock = time.perf_counter if wall else time.process_time
        off, nodes_off = build(name, scenario, which, False)
        on, nodes_on = build(name, scenario, which, True)
        for f in (off, on, off, on):
            f()
        calls = 20 if name == "cnn" and scenario in ("infer1", "ortmodule1") else (4 if scenario == "infer1" else 1)
        times = {"off": [], "on": []}
        for _ in range(ROUNDS):
            for key, f in (("off", off), ("on", on)):
                t0 = clock()
                for _ in range(calls):
                    f()
                times[key].append((clock() - t0) / calls)
        m_off, m_on = statistics.median(times["off"]), statistics.median(times["on"])
        print(
            f"| {name} | {scenario} | {m_off * 1e3:.3f} | {m_on * 1e3:.3f} | {m_on / m_off:.2f} | "
            f"{min(times['off']) * 1e3:.3f} | {min(times['on']) * 1e3:.3f} | {nodes_off} / {nodes_on} |",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
