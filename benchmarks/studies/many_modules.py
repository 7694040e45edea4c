"""Many tiny ORTModules, as onnxruntime-training's einsum tests build them: one
``lort.ORTModule`` per einsum equation over up to four letters (a bias added to the left
operand, then ``torch.einsum``), each trained for 5 steps at sizes 16/32/8/64 and checked
against eager (outputs and the bias's gradient, atol = rtol = 1e-3, the tests' own
tolerance). Reports the time per module (first call to last step) and, with
``--modes``, the same run through lort's run modes that skip its work (``pytorch``:
capture and partition only), which bounds what lort's own compile can save.

    python benchmarks/studies/many_modules.py [--cases N] [--modes default,pytorch]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import random
import statistics
import time

import torch

import lort

SIZES = {"a": 16, "b": 32, "c": 8, "d": 64}


def equations() -> list[str]:
    """Left operands a, ab, abc; right operands every ordering of 1-3 letters that names
    the letters in first use order; 8 sampled outputs each (seeded)."""
    rng = random.Random(0)
    letters = "abcd"
    out = []
    for lhs in ("a", "ab", "abc"):
        for k in (1, 2, 3):
            for rhs in ("".join(p) for p in itertools.permutations(letters, k)):
                union = sorted(set(lhs + rhs))
                only_right = [c for c in rhs if c not in lhs]
                if "".join(union) != letters[:len(union)] or only_right != sorted(only_right):
                    continue
                outputs = ["".join(p) for i in range(1, len(union) + 1)
                           for c in itertools.combinations(union, i) for p in itertools.permutations(c)]
                rng.shuffle(outputs)
                out += [f"{lhs},{rhs}->{o}" for o in outputs[:8]]
    return out


class Einsum(torch.nn.Module):
    def __init__(self, equation: str, size: int):
        super().__init__()
        self.equation = equation
        self.bias = torch.nn.Parameter(torch.randn(size))

    def forward(self, left, right):
        return torch.einsum(self.equation, left + self.bias, right)


def run(cases: list[str], options: dict, counts: dict | None = None) -> list[float]:
    """Seconds per module; ``counts`` gets how many modules ran uncompiled (eager under
    lort's cheapest call), ran through lort with ORT runs, or ran eager after timing."""
    times = []
    torch.manual_seed(0)
    for eq in cases:
        start = time.perf_counter()
        lhs, rhs = eq.split("->")[0].split(",")
        eager = Einsum(eq, SIZES[lhs[-1]])
        ort_model = lort.ORTModule(copy.deepcopy(eager), options=lort.Options(**options))
        for _ in range(5):
            left, right = torch.rand([SIZES[c] for c in lhs]), torch.rand([SIZES[c] for c in rhs])
            want, got = eager(left, right), ort_model(left, right)
            want.sum().backward()
            got.sum().backward()
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
            torch.testing.assert_close(ort_model.bias.grad, eager.bias.grad, atol=1e-3, rtol=1e-3)
        times.append(time.perf_counter() - start)
        if counts is not None:
            records = ort_model.transition_manager.records
            if any(r.executor_times.get("floor") for r in records):
                how = "uncompiled"
            elif all(r.executor == "pytorch" for r in records):
                how = "eager after timing"
            else:
                how = "through lort"
            counts[how] = counts.get(how, 0) + 1
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=None, help="the first N equations (default: all)")
    ap.add_argument("--modes", default="default")
    a = ap.parse_args()
    cases = equations()[:a.cases]
    run(cases[:1], {})  # imports and first-use costs, not counted
    for mode in a.modes.split(","):
        options = {} if mode == "default" else {"mode": mode}
        counts: dict = {}
        times = run(cases, options, counts)
        print(f"| {mode} | {len(cases)} | {sum(times):.1f} | {statistics.median(times):.3f} | "
              f"{max(times):.3f} | {counts.get('uncompiled', 0)} | {counts.get('eager after timing', 0)} | "
              f"{counts.get('through lort', 0)} |", flush=True)


if __name__ == "__main__":
    main()
