"""What ORTModule's inference call costs besides its ORT session: the frozen-weight check
(runtime/frozen.py) measured cold, right after a session run as it happens on every
call, and hot, right after itself; against the session alone, the whole ORTModule call
and the model exported whole to ORT (benchmarks/whole_ort.py).

For each model and batch, in one process: ``lort.ORTModule(model)`` in eval mode under
torch.no_grad, warmed until its direct-inference lane serves; its single ORT group, that
group's frozen session and its weight guard. Timed round-robin, ``--rounds`` rounds of
``--calls`` calls each, median of the rounds:

- session: the group's session run on the call's input alone (binding and output
  allocation included, as every route does);
- ORTModule: the whole call;
- whole ORT: the exported model's step.

The check is timed alone, once per round after a session run (cold: the run's data
evicted the weights' tensor objects from the caches) and once more right after (hot):
lort's C++ check (runtime/weight_check.cpp, what ORTModule ran where it is built) and
the Python one over the same tensors, both reading each weight from its module's
registry as ORTModule's route does; the Python one also split into its parts: identity,
version counter and data pointer of each frozen tensor (freeze=True checks only these),
and the sampled element of each (freeze="auto", the default, adds it: it sees writes
through ``p.data``).

    python benchmarks/studies/guard_cost.py [--models mlp,cnn,mobilenetv3,vit] [--batches 1,8] [--out F]
"""

from __future__ import annotations

import argparse
import datetime
import operator
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this study's folder, then benchmarks/ (the shared modules)

from report import machine  # noqa: E402
from whole_ort import whole_ort_step  # noqa: E402

import lort  # noqa: E402
from lort.module.direct import _single_group  # noqa: E402
from lort.runtime import native  # noqa: E402
from lort.runtime.frozen import _DATA_PTR, _VERSION, FrozenWeight, WeightGuard  # noqa: E402
from lort.testing.models import CASES  # noqa: E402

MODELS = ["mlp", "cnn", "transformer", "bert", "resnet18", "mobilenetv3", "vit"]


def _group(om):
    entry = [e for e in om.transition_manager.entries.values() if not e.key.grad_enabled][-1]
    fn = entry.runner._fn
    single = _single_group(getattr(fn, "chosen", None) or fn)
    return None if single is None else single[0]


def measure(name: str, batch: int, rounds: int, calls: int) -> dict | str:
    torch.manual_seed(0)
    model, args = CASES[name].make(batch)
    model.eval()
    om = lort.ORTModule(model)
    with torch.no_grad():
        for _ in range(5):
            om(*args)
        group = _group(om)
        if group is None or group._guard is None or group._frozen_sessions.get(False) is None:
            return "not one ORT group with frozen weights"
        guard, sess = group._guard, group._frozen_sessions[False]
        weights = tuple(guard.tensors)
        seen = []  # the session's inputs on a call, as the route passes them
        bind = sess._bind_inputs
        sess._bind_inputs = lambda live, binding: seen.append(list(live)) or bind(live, binding)
        try:
            om(*args)
        finally:
            del sess._bind_inputs
        if len(seen) != 1:
            return "the call did not run the frozen session once"
        live = seen[0]
        whole = whole_ort_step(model, args)
        if isinstance(whole, str):
            return whole
        if guard._registries is None:
            return "the route did not register the weights' registries"
        py = _python_guard(guard)
        py.register(*guard._registries)
        parts = {
            "C++": guard.registered_check,
            "Python": py.same_registered,
            "ids, versions, pointers": lambda: (all(map(operator.is_, weights, py.tensors))
                                                and list(map(_VERSION, weights)) == py.versions
                                                and list(map(_DATA_PTR, weights)) == py.ptrs),
            "samples": lambda: list(map(operator.getitem, py._views, py._where)) == py._values,
        }
        if parts["C++"] is None:
            del parts["C++"]
        steps = {"session": lambda: sess.run(live), "ORTModule": lambda: om(*args), "whole ORT": whole}
        times = {k: [] for k in steps}
        cold = {k: [] for k in parts}
        hot = {k: [] for k in parts}
        for _ in range(rounds):
            for k, f in steps.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    f()
                times[k].append((time.perf_counter() - t0) / calls)
            for k, f in parts.items():
                sess.run(live)
                t0 = time.perf_counter()
                f()
                t1 = time.perf_counter()
                f()
                cold[k].append(t1 - t0)
                hot[k].append(time.perf_counter() - t1)
    med = statistics.median
    return {"weights": len(weights), "times": {k: med(v) for k, v in times.items()},
            "cold": {k: med(v) for k, v in cold.items()}, "hot": {k: med(v) for k, v in hot.items()}}


def _python_guard(guard: WeightGuard) -> WeightGuard:
    """A guard over the same tensors that checks in Python."""
    load = native.load
    native.load = lambda: None
    try:
        return WeightGuard(tuple(FrozenWeight(i, n, t) for i, (n, t) in enumerate(zip(guard.names, guard.tensors))),
                           guard.sample)
    finally:
        native.load = load


def _cold_hot(r: dict, part: str) -> str:
    if part not in r["cold"]:
        return "not built | -"
    c, h = r["cold"][part], r["hot"][part]
    return f"{c * 1e6:.0f} ({c / r['weights'] * 1e9:.0f} ns) | {h * 1e6:.0f}"


def row(name: str, batch: int, r: dict | str) -> str:
    if isinstance(r, str):
        return f"| {name} | {batch} | {r} |" + " |" * 10
    us = {k: v * 1e6 for k, v in r["times"].items()}
    c = r["cold"]
    return (f"| {name} | {batch} | {r['weights']} | {us['session']:.0f} | {us['ORTModule']:.0f} | {us['whole ORT']:.0f} "
            f"| {_cold_hot(r, 'C++')} | {_cold_hot(r, 'Python')} "
            f"| {c['ids, versions, pointers'] * 1e6:.0f} / {c['samples'] * 1e6:.0f} "
            f"| {us['whole ORT'] / us['ORTModule']:.2f}x | {us['whole ORT'] / us['session']:.2f}x |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(HERE, "guard_cost.md"))
    a = ap.parse_args(argv)
    start = time.time()
    lines = [
        "| model | batch | frozen weights | session µs | ORTModule µs | whole ORT µs | C++ check cold µs (per weight) "
        "| C++ check hot µs | Python check cold µs (per weight) | Python check hot µs "
        "| Python cold: ids, versions, pointers / samples µs | ORTModule vs whole ORT | session vs whole ORT |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in a.models.split(","):
        for batch in map(int, a.batches.split(",")):
            lines.append(row(name, batch, measure(name, batch, a.rounds, a.calls)))
            print(lines[-1], flush=True)
    minutes = (time.time() - start) / 60
    text = "\n".join([
        "# ORTModule's per-call cost besides its ORT session: the frozen-weight check",
        "",
        f"Taken by `python benchmarks/studies/guard_cost.py` on {datetime.date.today()} ({minutes:.1f} min). "
        f"Machine: {machine()}.",
        "",
        "Medians of " + f"{a.rounds} rounds of {a.calls} calls, timed round-robin in one process (the "
        "script's docstring says how). \"vs whole ORT\" = whole-model ORT time / this time.",
        "",
        *lines,
        "",
    ])
    with open(a.out, "w") as f:
        f.write(text)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
