"""lort's inference graph in ORT against the same model exported whole, in one process.

benchmarks/results/batched_inference.md found lort 0.87-0.99x the speed of the whole model
exported to ORT at batch 8 (``whole_ort.py``), where lort runs its graph in ORT, but not
where the difference lies: Dynamo's per-call cost is about 1 ms of 340-1940 ms calls. This
study takes it apart for one case (``lort.testing.models.ENGINE_CASES``) at one batch:

1. the model in eval mode, under ``torch.no_grad``; ``torch.compile(model, backend="lort",
   options={"executor": "ort", "engines": ("ort", "pytorch"), "disk_cache": False})``
   called twice; every ``GroupSession`` run is recorded with its last inputs (cloned);
2. the whole export (``whole_ort.whole_ort_step``: ``torch.onnx.export(dynamo=True)``,
   ORT_ENABLE_ALL, lort's thread settings, checked against eager);
3. ``--rounds`` rounds, each running, in turn (the order reversed every other round): the
   compiled model; lort's recorded sessions alone, replayed on their kept inputs one after
   the other (``GroupSession.run``, binding included: what lort's graph costs inside
   ORT); and the whole export; the medians of each;
4. each graph's op-type counts as ORT optimized it (``session.save_optimized`` for
   lort's groups, ``optimized_model_filepath`` for the export), side by side where they
   differ;
5. with ``--profile``, ORT's profiler on in lort's sessions and the export's (both
   rebuilt), ``--runs`` profiled runs of each, and each op type's kernel time per run
   (the profiler's own cost is in both, alike).

    python benchmarks/studies/graph_vs_export.py [--case vit_small] [--batch 8] [--rounds 8] [--profile]

Prints Markdown; the reading is in benchmarks/results/batched_inference.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
sys.path.insert(0, BENCH)


def _ops(path: str) -> collections.Counter:
    import onnx

    m = onnx.load(path, load_external_data=False)
    return collections.Counter(f"{n.domain}:{n.op_type}" if n.domain else n.op_type for n in m.graph.node)


def _profile(sess, runs: int, run) -> dict[str, float]:
    """ms per run of each op type's kernels in ``sess`` (profiling on) over ``runs`` runs."""
    for _ in range(runs):
        run()
    with open(sess.end_profiling(), encoding="utf-8") as f:
        events = json.load(f)
    per = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per[e["args"]["op_name"]] += e["dur"]
    return {op: us / runs / 1e3 for op, us in per.items()}


def measure(case: str, batch: int, rounds: int, profile: bool, runs: int, extra: dict | None = None) -> dict:
    from lort.testing.models import ENGINE_CASES, make_torchvision_importable

    make_torchvision_importable()
    import onnxruntime as ort
    import torch

    import lort.runtime.session as session
    import whole_ort

    model, args, _ = ENGINE_CASES[case](batch)  # positional inputs only, as benchmarks/batched.py runs them
    if getattr(getattr(model, "config", None), "use_cache", False):  # a forward's logits, no cache object
        model.config.use_cache = False
    model.eval()
    made, kept = {}, {}
    create, run = session.create_session, session.GroupSession.run

    def recorded(mdl, device, options, name, threads, *a, **k):
        made[name] = (mdl, device, options, threads)
        return create(mdl, device, options, name, threads, *a, **k)

    def recording(self, a):
        kept[self.name] = (self, [x.clone() if isinstance(x, torch.Tensor) else x for x in a])
        return run(self, a)

    session.create_session, session.GroupSession.run = recorded, recording
    options = {"executor": "ort", "engines": ("ort", "pytorch"), "disk_cache": False, **(extra or {})}
    compiled = torch.compile(model, backend="lort", options=options)
    with torch.no_grad():
        compiled(*args)
        compiled(*args)
    session.create_session, session.GroupSession.run = create, run
    groups = list(kept.values())
    whole = whole_ort.whole_ort_step(model, args)
    if isinstance(whole, str):
        raise SystemExit(f"{case}: the whole export cannot run: {whole}")

    def run_compiled():
        with torch.no_grad():
            compiled(*args)

    def run_groups():
        for sess, a in groups:
            sess.run(a)

    steps = (("lort", run_compiled), ("lort's sessions", run_groups), ("whole ORT", whole))
    times = {name: [] for name, _ in steps}
    for fn in (f for _, f in steps):
        fn()
    for r in range(rounds):
        for name, fn in (steps if r % 2 == 0 else steps[::-1]):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    result = {"ms": {k: statistics.median(v) * 1e3 for k, v in times.items()}, "groups": len(groups)}

    with tempfile.TemporaryDirectory(prefix="lort-vs-export-") as tmp:
        lort_ops = collections.Counter()
        for sess, _ in groups:
            mdl, device, options, threads = made[sess.name]
            path = os.path.join(tmp, f"{sess.name}.onnx")
            session.save_optimized(mdl, path, device, options, threads)
            lort_ops += _ops(path)
        model_bytes = whole_ort.export_bytes(model, args)
        so = whole_ort.session_options()
        so.optimized_model_filepath = os.path.join(tmp, "whole.onnx")
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "whole.onnx.data")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
        result["ops"] = {"lort": lort_ops, "whole": _ops(os.path.join(tmp, "whole.onnx"))}
        if profile:
            spent = {"lort": collections.Counter()}
            for sess, a in groups:
                mdl, device, options, threads = made[sess.name]
                so = session.session_options(options, threads, quiet=True)
                so.enable_profiling, so.profile_file_prefix = True, os.path.join(tmp, sess.name)
                prof = session.create_session(mdl, device, options, sess.name, threads, count=False, so=so)
                feeds = {i.name: x.numpy() for i, x in zip(prof.get_inputs(), a) if isinstance(x, torch.Tensor)}
                spent["lort"].update(_profile(prof, runs, lambda p=prof, f=feeds: p.run(None, f)))
            so = whole_ort.session_options()
            so.enable_profiling, so.profile_file_prefix = True, os.path.join(tmp, "whole")
            prof = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
            feeds = {i.name: x.numpy() for i, x in zip(prof.get_inputs(), args)}
            spent["whole"] = _profile(prof, runs, lambda: prof.run(None, feeds))
            result["profile"] = spent
    return result


def markdown(case: str, batch: int, r: dict) -> list[str]:
    ms = r["ms"]
    lines = [f"### {case}, batch {batch}", "",
             "| run | ms | whole ORT / it |", "|---|---:|---:|"]
    lines += [f"| {name} | {t:.1f} | {ms['whole ORT'] / t:.3f}x |" for name, t in ms.items()]
    lines += ["", f"lort's groups: {r['groups']}.", "",
              "| op type (as ORT optimized each graph) | lort's groups | whole export |", "|---|---:|---:|"]
    lo, wh = r["ops"]["lort"], r["ops"]["whole"]
    for op in sorted(set(lo) | set(wh), key=lambda o: -(lo.get(o, 0) + wh.get(o, 0))):
        if lo.get(op, 0) != wh.get(op, 0):
            lines.append(f"| {op} | {lo.get(op, 0)} | {wh.get(op, 0)} |")
    lines.append(f"| all nodes | {sum(lo.values())} | {sum(wh.values())} |")
    if "profile" in r:
        lp, wp = r["profile"]["lort"], r["profile"]["whole"]
        lines += ["", "| op type | lort kernels ms / run | whole export ms / run | difference |", "|---|---:|---:|---:|"]
        for op in sorted(set(lp) | set(wp), key=lambda o: -abs(lp.get(o, 0) - wp.get(o, 0))):
            a, b = lp.get(op, 0.0), wp.get(op, 0.0)
            if max(a, b) >= 0.05:
                lines.append(f"| {op} | {a:.2f} | {b:.2f} | {a - b:+.2f} |")
        lines.append(f"| all kernels | {sum(lp.values()):.2f} | {sum(wp.values()):.2f} | "
                     f"{sum(lp.values()) - sum(wp.values()):+.2f} |")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="vit_small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--profile", action="store_true", help="also each op type's kernel time, ORT's profiler on")
    ap.add_argument("--runs", type=int, default=5, help="profiled runs of each graph (with --profile)")
    ap.add_argument("--options", default="{}", help="more lort options for its compile, as JSON")
    a = ap.parse_args(argv)
    import report

    r = measure(a.case, a.batch, a.rounds, a.profile, a.runs, json.loads(a.options))
    print(f"`{report.command('studies/graph_vs_export.py', argv)}`; {report.machine_line()}")
    print()
    print("\n".join(markdown(a.case, a.batch, r)))


if __name__ == "__main__":
    main()
