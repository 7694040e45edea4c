"""PyTorch's OpInfo conformance sweep through lort: every op of ``op_db``, float32, float64
and int64 where the op supports them, the first samples of each, forward outputs and
input gradients against eager (lort.testing.conformance says how). Runs the ops in worker
processes and writes benchmarks/results/conformance.md (and, with ``--json``, the raw results).

    python -m benchmarks conformance [--workers 2] [--ops add,sin] [--dtypes float32]
                                     [--samples 2] [--no-extreme] [--out FILE] [--json FILE]

``--samples 0`` runs only the extreme-value sample (lort.testing.conformance_extreme).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import time

from lort.testing import conformance
from lort.testing.conformance_pool import run_sweep

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(results: list, args, seconds: float) -> str:
    by_dtype = conformance.totals(results)
    statuses = [s for s in conformance.STATUSES if any(c[s] for c in by_dtype.values())]
    lines = [
        "# OpInfo conformance: PyTorch's op database through lort",
        "",
        f"Taken by `make conformance` (`{report.command('conformance', getattr(args, 'argv', None))}`) on "
        f"{datetime.date.today().isoformat()}: every op of "
        "`torch.testing._internal.common_methods_invocations.op_db`, for float32, float64 and "
        f"int64 where the op supports them, its first {args.samples} sample inputs, through "
        "`torch.compile(fn, backend=lort.LortBackend(...), fullgraph=False)` against eager "
        "PyTorch: forward outputs, and for float dtypes of ops that support backward the "
        "gradients of the inputs; then, for float dtypes, an extreme-value sample (outputs only: "
        "`lort.testing.conformance_extreme`). `assert_close(equal_nan=True)` with rtol=1.3e-4, atol=1e-4 "
        "(float32), rtol=atol=1e-7 (float64), exact for integers. Backend options "
        f"`{conformance.BACKEND_OPTIONS}`. An op whose eager result is not reproducible (two "
        "eager runs differ: random ops) is not applicable. The harness is "
        "`lort.testing.conformance`; its `XFAILS` lists the expected failures.",
        "",
        f"Machine: {report.host()}; {args.workers} worker process(es), "
        f"one thread each; {report.versions(extra=('onnx', 'onnx-ir'))}.",
        f"Run time: {seconds / 60:.1f} min for {len({r.op for r in results})} ops.",
        "",
        "## Totals",
        "",
        "| dtype | " + " | ".join(statuses) + " | total |",
        "|---|" + "---:|" * (len(statuses) + 1),
    ]
    for dtype, counts in by_dtype.items():
        lines.append(f"| {dtype} | " + " | ".join(str(counts[s]) for s in statuses) + f" | {sum(counts.values())} |")
    share = conformance.mean_ort_share(results)
    measured = [r for r in results if r.ort_share is not None]
    pooled_ort = sum(r.ort_nodes for r in results)
    pooled_all = pooled_ort + sum(r.torch_nodes for r in results)
    lines += [
        "",
        f"Share of ATen nodes in ORT: mean over the {len(measured)} (op, dtype) results that "
        f"captured ATen nodes {_pct(share)}; pooled over all nodes {_pct(pooled_ort / pooled_all if pooled_all else None)} "
        f"({pooled_ort} of {pooled_all}). Not counting the nodes the fuser leaves to PyTorch "
        f"as views only (a view in ORT would be a copy, nothing to gain): mean "
        f"{_pct(conformance.mean_ort_share_without_views(results))}.",
        "",
        "Statuses: *right* every sample matched eager; *fell back* right, but lort warned that "
        "a group or node runs in PyTorch after failing to translate or to run in ORT (the "
        "support check should have kept it out); *wrong* a value differs from eager; *crash* "
        "lort raised (or the worker died or timed out); *n/a* not applicable, with the reason; "
        "*known difference* the extreme-value sample differs for a reason listed in "
        "`conformance_extreme.KNOWN_DIFFERENCES` (PyTorch's own kernel in overflow territory, an input "
        "outside the op's domain); *xfail* an expected failure listed in `XFAILS`.",
        "",
        "## Every (op, dtype) that is not right",
        "",
        "| op | dtype | status | detail |",
        "|---|---|---|---|",
    ]
    order = {s: i for i, s in enumerate(("wrong", "crash", "xpass", "xfail", "fell back", "n/a"))}
    bad = sorted((r for r in results if r.status != "right"), key=lambda r: (order.get(r.status, 9), r.op, r.dtype))
    for r in bad:
        lines.append(f"| `{r.op}` | {r.dtype} | {r.status} | {_cell(r.detail)} |")
    lines += [
        "",
        "## Share of ATen nodes in ORT per op family",
        "",
        "Mean over the family's (op, dtype) results of each result's share; nodes pooled.",
        "",
        "| family | results | mean share in ORT | nodes in ORT | nodes in PyTorch |",
        "|---|---:|---:|---:|---:|",
    ]
    fams = collections.defaultdict(list)
    for r in measured:
        fams[r.family].append(r)
    for fam, rs in sorted(fams.items(), key=lambda kv: -sum(r.torch_nodes for r in kv[1])):
        lines.append(
            f"| {fam} | {len(rs)} | {_pct(conformance.mean_ort_share(rs))} | "
            f"{sum(r.ort_nodes for r in rs)} | {sum(r.torch_nodes for r in rs)} |"
        )
    kinds = collections.Counter()
    ops_by_kind = collections.defaultdict(collections.Counter)
    example = {}
    for r in results:
        for (kind, op), n in r.fallbacks.items():
            kinds[kind] += n
            ops_by_kind[kind][op] += n
        for kind, text in r.reasons.items():
            example.setdefault(kind, text)
    lines += [
        "",
        "## Why nodes stayed in PyTorch, by reason kind",
        "",
        "Nodes over every (op, dtype) result; the ATen ops most often left there for that reason; "
        "an example reason.",
        "",
        "| reason kind | nodes | most frequent ops | example |",
        "|---|---:|---|---|",
    ]
    for kind, n in kinds.most_common():
        top = ", ".join(f"`{op.replace('aten.', '')}` x{c}" for op, c in ops_by_kind[kind].most_common(8))
        lines.append(f"| {kind} | {n} | {top} | {_cell(example.get(kind, ''))} |")
    slow = sorted(results, key=lambda r: -r.seconds)[:10]
    lines += [
        "",
        "Slowest (op, dtype): " + ", ".join(f"`{r.op}` {r.dtype} {r.seconds:.0f} s" for r in slow) + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--ops", default=None, help="comma-separated OpInfo names (default: all)")
    ap.add_argument("--dtypes", default=",".join(conformance.DTYPES))
    ap.add_argument("--samples", type=int, default=conformance.SAMPLES)
    ap.add_argument("--no-extreme", action="store_true", help="skip the extreme-value sample")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per op (all its dtypes)")
    ap.add_argument("--out", default=report.result_path("conformance.md"))
    ap.add_argument("--json", default=None, help="where to write the raw results (default: none)")
    a = ap.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    names = a.ops.split(",") if a.ops else list(conformance.ops_by_id())
    dtypes = a.dtypes.split(",")
    done = [0]

    def progress(r):
        done[0] += 1
        if r.status not in ("right", "n/a"):
            print(f"[{done[0]}] {r.op} {r.dtype}: {r.status}: {r.detail[:200]}", flush=True)
        elif done[0] % 100 == 0:
            print(f"[{done[0]}] ...", flush=True)

    start = time.perf_counter()
    results = run_sweep(names, dtypes, workers=a.workers, samples=a.samples, op_timeout_s=a.timeout,
                        on_result=progress, extreme=not a.no_extreme)
    seconds = time.perf_counter() - start
    results.sort(key=lambda r: (r.op, list(conformance.DTYPES).index(r.dtype)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"seconds": seconds, "results": [r.to_json() for r in results]}, f)
    report.write_file(a.out, render(results, a, seconds))
    for dtype, counts in conformance.totals(results).items():
        print(dtype, dict(counts))
    print(f"mean ORT share {_pct(conformance.mean_ort_share(results))} "
          f"({_pct(conformance.mean_ort_share_without_views(results))} without views only); "
          f"{seconds / 60:.1f} min; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
