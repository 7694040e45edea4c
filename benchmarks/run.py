"""eager vs inductor vs lort, side by side in one process, on CPU or on a CUDA device.

For each model: batch-1 inference latency, batch-8 inference latency and a training
step (forward + backward), the median of repeated timings, and the first call (capture
+ compile). Prints a ratio table (speed-up over eager: eager time / time) and writes it
with the machine and versions to benchmarks/results/speed.md. Inference rows also time the
same model exported whole to ORT (benchmarks/whole_ort.py: weights as initializers, one
session at ORT_ENABLE_ALL), with lort's speed-up over it, or why it could not run.

    python -m benchmarks speed [--models bert,resnet18] [--scenarios infer1,infer8,train] [--out FILE]

With ``--device cuda``: the models at issue 10's sizes (lort.testing.models.CUDA_CASES:
BERT-6L/768, GPT-2-6L/768, Llama-4L/1024 with GQA, all on 128 tokens, ResNet-50 and
ViT-S/16 at 224 px), inference at batch 1 and 32 and a training step at batch 32, each
sample timed with torch.cuda.synchronize() before and after its calls; written to
benchmarks/results/cuda.md with the device, driver and versions. ``--json FILE`` keeps
the rows in FILE and adds those of earlier runs on the same device to the table (a GPU
machine's command time is limited: run a few models per call). benchmarks/gpu_run.sh
runs it on a GPU machine.

    python -m benchmarks cuda [--models bert,gpt2] [--json rows.json]

(``python -m benchmarks cuda`` runs this script with ``--device cuda``.)
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os
import sys
import time

import torch

from lort.testing.models import CASES, CUDA_CASES, make_torchvision_importable, output_tensor

make_torchvision_importable()

import lort  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cuda_common  # noqa: E402
import report  # noqa: E402
import timing  # noqa: E402
from module_column import HEADER_CELLS, HEADER_RULE, MODULE, add_module_step, module_cells, module_summary, module_where  # noqa: E402,E501
from report import geomean, machine  # noqa: E402
from timing import first_call_seconds, grad_mode, timed_interleaved  # noqa: E402
from whole_ort import WHOLE, WHOLE_TEXT, whole_cells, whole_notes, whole_ort_step, whole_summary  # noqa: E402

SCENARIOS = {"infer1": ("inference", 1), "infer8": ("inference", 8), "train": ("train", 8)}
CUDA_SCENARIOS = {"infer1": ("inference", 1), "infer32": ("inference", 32), "train32": ("train", 32)}
BACKENDS = ["eager", "inductor", "lort"]


def cases_for(device: str) -> dict:
    return CUDA_CASES if device == "cuda" else CASES


def scenarios_for(device: str) -> dict:
    return CUDA_SCENARIOS if device == "cuda" else SCENARIOS


def _no_sync() -> None:
    pass


def model_and_args(name, scenario, device="cpu"):
    """(kind, model, args): a fresh copy of the case's model on ``device``, in eval mode for inference."""
    kind, batch = scenarios_for(device)[scenario]
    model, args = cases_for(device)[name].make(batch, seed=0)
    model = copy.deepcopy(model)
    if device != "cpu":
        model = model.to(device)
        args = tuple(a.to(device) for a in args)
    if kind == "inference":
        model.eval()
    return kind, model, args


def add_whole(name, scenario, steps, device="cpu", sync=_no_sync):
    """For an inference scenario, add the step of the model exported whole to ORT to
    ``steps`` and return None, or return why it cannot run ("export fails: ...");
    for training, return "-" (not measured)."""
    if scenarios_for(device)[scenario][0] != "inference":
        return "-"
    try:
        _, model, args = model_and_args(name, scenario, device)
        step = whole_ort_step(model, args, device)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: reported in the table
        step = f"fails: {type(e).__name__}: {str(e).strip()[:200]}"
    if isinstance(step, str):
        print(f"{name} {scenario} whole-model ORT: {step}", flush=True)
        return step
    sync()
    steps[WHOLE] = step
    return None


def make_runner(name, scenario, backend, device="cpu"):
    kind, model, args = model_and_args(name, scenario, device)
    if backend == "eager":
        fn = model
    elif backend == "inductor":
        fn = torch.compile(model)
    else:
        fn_backend = lort.LortBackend()
        fn = torch.compile(model, backend=fn_backend)
    if kind == "inference" and timing.PER_CALL_NO_GRAD:
        def step():
            with torch.no_grad():
                return fn(*args)
    elif kind == "inference":  # called under run()'s no_grad
        def step():
            return fn(*args)
    else:
        params = [p for p in model.parameters() if p.requires_grad]

        def step():
            for p in params:
                p.grad = None
            out = output_tensor(fn(*args))
            out.float().pow(2).mean().backward()
    if backend == "lort":
        step.backend = fn_backend
    return step


def run(models, scenarios, min_time):
    rows = []
    for name in models:
        for scenario in scenarios:
            torch._dynamo.reset()
            steps, firsts = {}, {}
            with grad_mode(SCENARIOS, scenario):
                # lort's first call times its graph against eager (executor="auto"): it is
                # made before inductor's, whose compile workers may still be busy after it.
                for backend in ("eager", "lort", "inductor"):
                    step = make_runner(name, scenario, backend)
                    firsts[backend] = first_call_seconds(step)
                    steps[backend] = step
                whole = add_whole(name, scenario, steps)
                if SCENARIOS[scenario][0] == "inference":
                    add_module_step(steps, firsts, *model_and_args(name, scenario)[1:], per_call=timing.PER_CALL_NO_GRAD)
                settle_engines(steps)
                times = timed_interleaved(steps, min_time * len(steps))
            where = where_lort_ran(steps["lort"])
            if MODULE in steps:
                where += f"; ORTModule {module_where(steps[MODULE])}"
            row = dict(model=name, scenario=scenario, times=times, firsts=firsts, where=where, whole=whole)
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def run_cuda(models, scenarios, min_time, on_row, profile=False):
    """As run() on the current CUDA device. A backend that fails leaves its error in the
    row instead of stopping the run (``on_row`` is called after each row, so a run cut
    short by the command's time limit keeps what it measured). ``profile``: also where
    each backend's step spends its time on the GPU (cuda_common.kernel_profile)."""
    sync = torch.cuda.synchronize
    rows = []
    for name in models:
        for scenario in scenarios:
            torch._dynamo.reset()
            steps, firsts, errors = {}, {}, {}
            with grad_mode(CUDA_SCENARIOS, scenario):
                for backend in ("eager", "lort", "inductor"):
                    try:
                        step = make_runner(name, scenario, backend, "cuda")
                        firsts[backend] = first_call_seconds(step, sync)
                        steps[backend] = step
                    except Exception as e:  # noqa: BLE001 - reported in the table
                        errors[backend] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
                        print(f"{name} {scenario} {backend} failed: {errors[backend]}", flush=True)
                whole = add_whole(name, scenario, steps, "cuda", sync)
                if CUDA_SCENARIOS[scenario][0] == "inference":
                    add_module_step(steps, firsts, *model_and_args(name, scenario, "cuda")[1:], sync,
                                    per_call=timing.PER_CALL_NO_GRAD)
                try:
                    # the fifth H200 run: ResNet-50's training graphs were not settled after
                    # 250 s and the call's cap ended the run before any row of it
                    unsettled = settle_engines(steps, float(os.environ.get("SETTLE_TIMEOUT", "150")))
                    if unsettled:
                        errors["settle"] = "; ".join(unsettled)
                    times = timed_interleaved(steps, min_time * len(steps), sync=sync) if steps else {}
                except Exception as e:  # noqa: BLE001 - reported in the table
                    times, errors["timing"] = {}, f"{type(e).__name__}: {str(e).strip()[:200]}"
                    print(f"{name} {scenario} timing failed: {errors['timing']}", flush=True)
                profiles = {b: cuda_common.kernel_profile(step) for b, step in steps.items()} if profile else None
            row = dict(
                model=name, scenario=scenario, times=times, firsts=firsts, errors=errors,
                where=(where_lort_ran(steps["lort"]) if "lort" in steps else "failed")
                + (f" ({errors['settle']})" if "settle" in errors else ""),
                peak_mib=torch.cuda.max_memory_reserved() / 2**20, whole=whole,
            )
            if profile:
                row["profile"] = profiles
            rows.append(row)
            print(format_row(row), flush=True)
            on_row(row)
            steps = step = None  # the models and their compiled graphs go
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return rows


def where_lort_ran(step) -> str:
    """Where lort ran the model: ORT (with how many of its groups executor='auto' moved
    to PyTorch), or eager PyTorch or inductor for graphs it timed faster there."""
    return where_records_ran(step.backend.records)


def where_records_ran(records) -> str:
    outside = {e: sum(r.executor == e for r in records) for e in ("pytorch", "inductor")}
    names = {"pytorch": "eager", "inductor": "inductor"}
    for engine, n in outside.items():
        if records and n == len(records):
            return names[engine]
    groups = [g for r in records if r.executor not in outside for g in r.groups]
    moved = sum(g.executor == "pytorch" for g in groups)
    where = "ORT" if not moved else f"ORT, {moved}/{len(groups)} groups PyTorch"
    return "; ".join([where] + [f"{n}/{len(records)} graphs {names[e]}" for e, n in outside.items() if n])


def settle_engines(steps: dict, timeout: float = 900.0) -> list[str]:
    """Call the lort and ORTModule steps until executor="auto" has chosen every graph's
    engine (compile/engines.py: inductor compiles in a subprocess from a graph's second
    call, then is timed against the placement running), so that the timing after it
    measures the engine chosen, not the machine under inductor's compile. Returns what
    each backend still waited for after ``timeout`` seconds (empty when all settled)."""
    unsettled = []
    for backend, step in steps.items():
        start = time.perf_counter()
        while any(s.engine is None for s in _switches(step)) and time.perf_counter() - start < timeout:
            step()
            time.sleep(0.05)
        waiting = [s.waiting for s in _switches(step) if s.engine is None]
        if waiting:
            unsettled.append(f"{backend}: {len(waiting)} graphs not settled after {timeout:.0f} s ({waiting[0]})")
            print(f"settle_engines: {unsettled[-1]}", flush=True)
    return unsettled


def _switches(step) -> list:
    backends = [step.backend] if getattr(step, "backend", None) is not None else []
    om = getattr(step, "module", None)
    if om is not None:
        backends += [e.backend for e in om.transition_manager.entries.values() if e.backend is not None]
    return [s for b in backends for s in (r() for r in b.switches) if s is not None]


def complete(row) -> bool:
    return all(b in row["times"] for b in BACKENDS)


def format_row(row):
    t = row["times"]
    if not complete(row):
        ms = " | ".join(f"{t[b] * 1e3:9.3f}" if b in t else "failed" for b in BACKENDS)
        firsts = " | ".join(f"{row['firsts'][b]:7.1f}" if b in row["firsts"] else "-" for b in ("inductor", "lort"))
        why = "; ".join(f"{b}: {e}" for b, e in row.get("errors", {}).items())
        return (f"| {row['model']:<12} | {row['scenario']:<7} | {ms} | - | - | {firsts} | {row['where']} ({why}) | "
                f"{whole_cells(row)} |{module_cells(row, WHOLE)}")
    return (
        f"| {row['model']:<12} | {row['scenario']:<7} | {t['eager'] * 1e3:9.3f} | {t['inductor'] * 1e3:9.3f} | "
        f"{t['lort'] * 1e3:9.3f} | {t['eager'] / t['lort']:6.2f}x | {t['inductor'] / t['lort']:6.2f}x | "
        f"{row['firsts']['inductor']:7.1f} | {row['firsts']['lort']:7.1f} | {row['where']} | {whole_cells(row)} |"
        f"{module_cells(row, WHOLE)}"
    )


HEADER = (
    "| model        | run     |  eager ms | inductor ms |  lort ms | lort vs eager | lort vs inductor | inductor 1st call s | lort 1st call s | lort ran in | whole ORT ms | lort vs whole ORT |"
    + HEADER_CELLS + "\n|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|" + HEADER_RULE
)


def cuda_report(rows: list, runs: int) -> str:
    lines = [
        "# lort benchmark results on CUDA",
        "",
        f"Taken {datetime.date.today().isoformat()} by `python -m benchmarks cuda` (eager, inductor and",
        "lort side by side in one process" + (f"; rows of {runs} runs on this device merged with --json)." if runs > 1 else ")."),
        f"Device: {cuda_common.machine()}.",
        f"Numerics: float32; {cuda_common.tf32_line()} (PyTorch's defaults unless changed).",
        "",
        "Times are the median of 11 samples per backend, taken round-robin across the backends; each sample is",
        "torch.cuda.synchronize(), n calls, torch.cuda.synchronize(), wall clock divided by n. Ratios are",
        "speed-ups (eager time / lort time, inductor time / lort time): above 1 means lort is faster.",
        "infer1/infer32: inference at batch 1 / 32 under torch.no_grad(), entered "
        + ("on each call" if timing.PER_CALL_NO_GRAD else "once around each measurement") + "; train32: forward + backward of",
        "`output.float().pow(2).mean()` at batch 32 (no optimizer step). lort runs with its defaults",
        "(executor='auto'). First call: capture + compile + first run, in seconds, in this process.",
        "Models: lort.testing.models.CUDA_CASES (random weights; BERT and GPT-2 6 layers of 768, Llama-style",
        "4 layers of 1024 with 16 heads and 4 key/value heads, 128 tokens; ResNet-50 and ViT-S/16 at 224 px).",
        *WHOLE_TEXT,
        "",
        HEADER,
        *[format_row(r) for r in rows],
        "",
        *whole_notes(rows),
    ]
    if any("profile" in r for r in rows):
        lines += [
            "Where the time goes (`--profile`): per step, device work seen by torch.profiler (CUPTI: ORT's",
            "kernels too), of it memory copies and fills, and the longest kernels; time is the step's time above.",
            "GPU work well below the time means the step waits on the host (launches, Python, synchronization).",
            "",
            *cuda_common.profile_table(rows, BACKENDS + [WHOLE]),
            "",
        ]
    done = [r for r in rows if complete(r)]
    for s in CUDA_SCENARIOS:
        sel = [r for r in done if r["scenario"] == s]
        if sel:
            ge = geomean([r["times"]["eager"] / r["times"]["lort"] for r in sel])
            gi = geomean([r["times"]["inductor"] / r["times"]["lort"] for r in sel])
            lines.append(
                f"- {s}: geomean lort speed-up {ge:.2f}x over eager, {gi:.2f}x over inductor ({len(sel)} models)"
                f"{whole_summary(sel)}{module_summary(sel, WHOLE)}"
            )
    failed = [f"{r['model']} {r['scenario']}" for r in rows if r not in done]
    if failed:
        lines.append(f"- failed (see the row): {', '.join(failed)}")
    lines += ["", "Issue 10's bars, from the rows above:"]
    infer1 = [r for r in done if r["scenario"] == "infer1"]
    if infer1:
        gi = geomean([r["times"]["inductor"] / r["times"]["lort"] for r in infer1])
        lines.append(f"- batch-1 inference geomean at least inductor's: {gi:.2f}x ({'met' if gi >= 1 else 'not met'})")
    slow_inf = [f"{r['model']} {r['scenario']} {r['times']['eager'] / r['times']['lort']:.2f}x" for r in done
                if r["scenario"] != "train32" and r["times"]["lort"] > r["times"]["eager"]]
    slow_train = [f"{r['model']} {r['times']['eager'] / r['times']['lort']:.2f}x" for r in done
                  if r["scenario"] == "train32" and r["times"]["lort"] > r["times"]["eager"]]
    lines.append(f"- no inference case below eager: {'met' if not slow_inf else 'not met: ' + ', '.join(slow_inf)}")
    lines.append(f"- training at least eager: {'met' if not slow_train else 'not met: ' + ', '.join(slow_train)}")
    return "\n".join(lines) + "\n"


def main_cuda(ap, a) -> None:
    why = cuda_common.cuda_unavailable()
    if why:
        ap.error(why)
    models = [m for m in (a.models or ",".join(CUDA_CASES)).split(",") if m]
    scenarios = [s for s in (a.scenarios or ",".join(CUDA_SCENARIOS)).split(",") if s]
    for m in models:
        if m not in CUDA_CASES:
            ap.error(f"unknown model {m!r} for --device cuda; choose from {list(CUDA_CASES)}")
    for s in scenarios:
        if s not in CUDA_SCENARIOS:
            ap.error(f"unknown scenario {s!r} for --device cuda; choose from {list(CUDA_SCENARIOS)}")
    out = a.out or report.result_path("cuda.md")
    rows = cuda_common.Rows(a.json, cuda_common.device_name(), key=("model", "scenario"))
    order = {"model": list(CUDA_CASES), "scenario": list(CUDA_SCENARIOS)}
    print(cuda_common.machine())
    print(cuda_common.tf32_line())
    print(HEADER, flush=True)

    def save(row):
        rows.add(row)
        # after each row: a run cut short keeps what it measured
        report.write_file(out, cuda_report(rows.all(order), rows.runs))

    run_cuda(models, scenarios, a.min_time, save, profile=a.profile)
    if rows.new:
        print("\n".join(l for l in cuda_report(rows.all(order), rows.runs).splitlines() if l.startswith("- ")))
        print(f"wrote {out}" + (f" and {a.json}" if a.json else ""))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--models", default=None, help=f"default: all ({','.join(CASES)}; on cuda {','.join(CUDA_CASES)})")
    ap.add_argument("--scenarios", default=None,
                    help=f"default: all ({','.join(SCENARIOS)}; on cuda {','.join(CUDA_SCENARIOS)})")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds of timed calls per measurement")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/speed.md (cuda: benchmarks/results/cuda.md)")
    ap.add_argument("--json", default=None, help="cuda: keep rows in this file and merge earlier runs' rows")
    ap.add_argument("--profile", action="store_true", help="cuda: also profile where each step's GPU time goes")
    ap.add_argument("--no-grad-per-call", action="store_true",
                    help="inference steps enter torch.no_grad() on each call (default: one no_grad per scenario)")
    a = ap.parse_args(argv)
    timing.PER_CALL_NO_GRAD = a.no_grad_per_call
    if a.device == "cuda":
        return main_cuda(ap, a)
    if a.json:
        ap.error("--json is for --device cuda")
    a.models = a.models or ",".join(CASES)
    a.scenarios = a.scenarios or ",".join(SCENARIOS)
    a.out = a.out or report.result_path("speed.md")
    models = [m for m in a.models.split(",") if m]
    scenarios = [s for s in a.scenarios.split(",") if s]
    for m in models:
        if m not in CASES:
            ap.error(f"unknown model {m!r}; choose from {list(CASES)}")
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}; choose from {list(SCENARIOS)}")
    print(machine())
    print(HEADER)
    rows = run(models, scenarios, a.min_time)
    lines = [
        "# lort benchmark results",
        "",
        f"Taken {datetime.date.today().isoformat()} by `{report.command('speed', argv)}` (all backends side by side in one process).",
        f"Machine: {machine()}.",
        "",
        "Times are the median of 11 samples per backend, taken round-robin across the backends",
        "(each sample a mean over repeated calls); ratios are speed-ups",
        "(eager time / lort time, inductor time / lort time): above 1 means lort is faster.",
        "infer1/infer8: inference at batch 1 / 8 under torch.no_grad(), "
        + ("entered on each call;" if timing.PER_CALL_NO_GRAD
           else "entered once around each measurement, not per call (the whole-model ORT step has none);"),
        "train: forward + backward at batch 8.",
        "First call: capture + compile + first run, in seconds, in this process, each backend with its on-disk",
        "cache as this machine had it (inductor's is often warm from earlier runs); `python -m benchmarks first-call`",
        "compares cold and warm first calls in fresh processes.",
        *WHOLE_TEXT,
        "",
        HEADER,
        *[format_row(r) for r in rows],
        "",
        *whole_notes(rows),
    ]
    for s in scenarios:
        sel = [r for r in rows if r["scenario"] == s]
        if sel:
            ge = geomean([r["times"]["eager"] / r["times"]["lort"] for r in sel])
            gi = geomean([r["times"]["inductor"] / r["times"]["lort"] for r in sel])
            lines.append(f"- {s}: geomean lort speed-up {ge:.2f}x over eager, {gi:.2f}x over inductor{whole_summary(sel)}"
                         f"{module_summary(sel, WHOLE)}")
    report.write_file(a.out, "\n".join(lines) + "\n", keep_sections=True)
    print("\n".join(lines[-len(scenarios):]))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
