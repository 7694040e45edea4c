"""lort at the sizes users run: first call, steady time and memory, beside eager and inductor.

Cases (lort.testing.models.SCALE_CASES, random weights from transformers configs):
``bert_base`` inference and training (BertModel(BertConfig()), batch 1 x 128 tokens),
``gpt2_small`` training (GPT2LMHeadModel(GPT2Config()) with its LM loss, batch 1 x 128)
and ``llama_2gb`` inference (a Llama-style causal LM of 0.92B parameters, 3.7 GB of
float32 weights, batch 1 x 128 tokens, ``use_cache=False``).

Each (case, backend) runs in a fresh Python process that imports alike (torch,
transformers, lort, onnxruntime, onnxscript, torch._dynamo, torch._inductor), builds the
model (and, for training, an AdamW optimizer), runs ``gc.collect()`` and reads its RSS:
the **baseline**. Then it makes the first call (inference: under ``torch.no_grad()``;
training: forward, backward, AdamW step, ``zero_grad``; ``fwdbwd``: forward and backward
without an optimizer, then ``zero_grad``) and ``--calls`` more:

- **first s**: the first call, compile included; lort with an empty disk cache and
  inductor with an empty cache directory, each a new temporary directory;
- **steady ms**: median of the later calls (after two warm-up calls);
- **peak MiB**: the process's highest RSS (VmHWM) during the first call, the compile
  included; ratio to eager's;
- **resident MiB**: RSS after the first call and ``gc.collect()`` (no malloc_trim: what
  the process holds as a user sees it); ratio to eager's; **trimmed**: the same after
  glibc's ``malloc_trim(0)``.

``--speed`` times training steps interleaved instead: one process per case and backend
holds two copies of the model (same initial weights), eager's and the backend's, warms
each up, then alternates their steps (the order flipped every round) and reports each
one's median step and the median over rounds of eager's step / the backend's (above 1:
faster than eager). ``eager-copy`` is a second eager copy: its row reads the noise.

    python -m benchmarks scale [--cases bert_base:infer,bert_base:train,bert_base:fwdbwd,...] [--backends eager,inductor,lort,ortmodule]
    python -m benchmarks scale --speed [--cases bert_base,gpt2_small] [--backends eager-copy,lort,ortmodule] [--rounds 30]

Writes benchmarks/results/scale.md (``--out``), replacing the section it writes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402
from report import write_section  # noqa: E402
BACKENDS = ["eager", "inductor", "lort", "ortmodule"]
CASES = ["bert_base:infer", "bert_base:train", "gpt2_small:train", "llama_2gb:infer"]

PRELUDE = r"""
import ctypes, gc, json, statistics, sys, time
import torch
from lort.testing.models import SCALE_CASES, make_torchvision_importable, output_tensor
make_torchvision_importable()
import transformers, lort, onnxruntime, onnxscript, torch._dynamo, torch._inductor.config  # alike in every process
sys.path.insert(0, sys.argv[1])
from rss import Sampler, reset_hwm, status, trim


def compiled(model, backend):
    if backend in ("eager", "eager-copy"):  # eager-copy: a second eager copy, to read the noise
        return model
    if backend == "inductor":
        return torch.compile(model)
    if backend == "lort":
        return torch.compile(model, backend="lort")
    return lort.ORTModule(model)


def step_fn(fn, model, args, kwargs, train, optimizer=True):
    if not train:
        def step():
            with torch.no_grad():
                out = fn(*args, **kwargs)
            del out
        return step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5) if optimizer else None

    def step():
        out = fn(*args, **kwargs)
        loss = out.loss if getattr(out, "loss", None) is not None else output_tensor(out).float().pow(2).mean()
        loss.backward()
        del out, loss
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)
    return step
"""

MEMORY_CHILD = PRELUDE + r"""
case, task, backend, calls = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
train = task in ("train", "fwdbwd")
model, args, kwargs = SCALE_CASES[case]()
model.train(train)
weights = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in model.state_dict().values()}.values())
fn = compiled(model, backend)
step = step_fn(fn, model, args, kwargs, train, optimizer=task != "fwdbwd")
gc.collect()
use_hwm = reset_hwm()
sampler = None if use_hwm else Sampler()
peak_of = (lambda: status()["VmHWM"]) if use_hwm else (lambda: sampler.take())
if sampler:
    sampler.take()
baseline = status()["VmRSS"]
t0 = time.perf_counter()
step()
first = time.perf_counter() - t0
peak_first = peak_of()
gc.collect()
resident = status()["VmRSS"]
trim()
trimmed = status()["VmRSS"]
for _ in range(2):  # warm-up: the calls right after a compile are slower in every backend
    step()
times = []
for _ in range(calls):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
peak = max(peak_first, peak_of())
gc.collect()
resident_end = status()["VmRSS"]
if sampler:
    sampler.stop = True
ort_runs = lort.stats.ort_runs
print(json.dumps(dict(baseline=baseline, weights=weights, first=first, peak_first=peak_first, peak=peak,
                      resident=resident, trimmed=trimmed, resident_end=resident_end,
                      steady=statistics.median(times), ort_runs=ort_runs,
                      method="VmHWM" if use_hwm else "sampled VmRSS")))
"""

SPEED_CHILD = PRELUDE + r"""
import copy
case, rounds, backend = sys.argv[2], int(sys.argv[3]), sys.argv[4]
model, args, kwargs = SCALE_CASES[case]()
model.train(True)
steps = {}
for b in ("eager", backend):  # each a copy of the same initial weights
    m = copy.deepcopy(model)
    steps[b] = step_fn(compiled(m, b), m, args, kwargs, True)
    for _ in range(3):  # compile, then warm
        steps[b]()
    gc.collect()
del model
times = {b: [] for b in steps}
for r in range(rounds):
    for b in (("eager", backend) if r % 2 == 0 else (backend, "eager")):
        t0 = time.perf_counter()
        steps[b]()
        times[b].append(time.perf_counter() - t0)
ratios = [e / o for e, o in zip(times["eager"], times[backend])]
print(json.dumps({"eager": statistics.median(times["eager"]), "backend": statistics.median(times[backend]),
                  "ratio": statistics.median(ratios)}))
"""


def run_child(script: str, *args: str, timeout: int = 3600, cache_dir: str | None = None) -> dict:
    """``script``'s result (the JSON of its last line) in a fresh process, with lort's and
    inductor's caches in ``cache_dir`` (kept: a second run there starts warm), else in
    a new empty directory."""
    with tempfile.TemporaryDirectory(prefix="lort-scale-") as tmp:
        where = cache_dir or tmp
        env = dict(os.environ, LORT_CACHE_DIR=os.path.join(where, "lort"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(where, "inductor"), LORT_PROGRESS="0")
        out = subprocess.run([sys.executable, "-c", script, HERE, *args], env=env, capture_output=True, text=True,
                             timeout=timeout)
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()
        return {"error": (tail[-1] if tail else f"exit {out.returncode}")[:300]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def grid_arguments(ap, cases: list[str], backends: list[str]) -> None:
    """``--cases`` and ``--backends`` on ``ap``, every name by default."""
    ap.add_argument("--cases", default=",".join(cases))
    ap.add_argument("--backends", default=",".join(backends))


def grid_choices(ap, a, cases: list[str], backends: list[str]) -> tuple[list[str], list[str]]:
    """The parsed ``--cases`` and ``--backends`` as lists; an unknown name is ``ap``'s
    error, naming the choices."""
    chosen = a.cases.split(","), a.backends.split(",")
    for names, known, what in ((chosen[1], backends, "backend"), (chosen[0], cases, "case")):
        for name in names:
            if name not in known:
                ap.error(f"unknown {what} {name!r}; choose from {known}")
    return chosen


def run_grid(script: str, cases: list[str], backends: list[str], *args: str) -> dict:
    """case -> backend -> ``script``'s result for that pair, each in a fresh process
    (``run_child``), printed as it comes."""
    results: dict = {}
    for case in cases:
        for b in backends:
            r = run_child(script, case, b, *args)
            print(case, b, r, flush=True)
            results.setdefault(case, {})[b] = r
    return results


def mib(b: float) -> str:
    return f"{b / 2**20:.0f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def memory_table(results: dict) -> list[str]:
    def heading(case, by_backend):
        weights = next((r["weights"] for r in by_backend.values() if "weights" in r), 0)
        return f"### {case} (weights {mib(weights)} MiB)"

    def row(b, r, by_backend):
        e, ind = by_backend.get("eager", {}), by_backend.get("inductor", {})
        ok_e, ok_i = "steady" in e, "steady" in ind
        return (
            f"| {b} | {r['first']:.1f} | {r['steady'] * 1e3:.1f} "
            f"| {ratio(e['steady'], r['steady']) if ok_e else '-'} "
            f"| {ratio(ind['steady'], r['steady']) if ok_i else '-'} "
            f"| {mib(r['baseline'])} | {mib(r['peak_first'])} "
            f"| {ratio(r['peak_first'], e['peak_first']) if ok_e else '-'} | {mib(r['resident'])} "
            f"| {ratio(r['resident'], e['resident']) if ok_e else '-'} | {mib(r['trimmed'])} | {r['ort_runs']} |"
        )

    return report.case_tables(
        results, heading,
        "| backend | first s | steady ms | vs eager | vs inductor | baseline MiB | peak MiB (first call) "
        "| peak / eager's | resident MiB | resident / eager's | trimmed MiB | ORT runs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", row)


def speed_table(results: dict) -> list[str]:
    lines = [
        "| case | backend | eager ms | backend ms | eager / backend (median of rounds) |",
        "|---|---|---:|---:|---:|",
    ]
    for (case, backend), r in results.items():
        if "error" in r:
            lines.append(f"| {case} | {backend} | failed: {r['error']} | | |")
            continue
        lines.append(f"| {case} | {backend} | {r['eager'] * 1e3:.1f} | {r['backend'] * 1e3:.1f} | {r['ratio']:.3f}x |")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=None)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default=report.result_path("scale.md"))
    a = ap.parse_args(argv)
    backends = a.backends.split(",")
    stamp = f"Taken {datetime.date.today()} by `{report.command('scale', argv)}`."
    if a.speed:
        cases = (a.cases or "bert_base,gpt2_small").split(",")
        results = {}
        for case in cases:
            for b in backends:
                if b == "eager":
                    continue
                results[(case, b)] = run_child(SPEED_CHILD, case, str(a.rounds), b)
                print(case, b, results[(case, b)], flush=True)
        lines = [stamp, report.machine_line(), "", *speed_table(results)]
        print("\n".join(lines))
        write_section(a.out, "scale:speed", lines)
        return
    results: dict = {}
    for spec in (a.cases or ",".join(CASES)).split(","):
        case, task = spec.split(":")
        results[f"{case} {task}"] = {}
        for b in backends:
            r = run_child(MEMORY_CHILD, case, task, b, str(a.calls))
            results[f"{case} {task}"][b] = r
            print(spec, b, r, flush=True)
    lines = [stamp, report.machine_line(), "", *memory_table(results)]
    print("\n".join(lines))
    write_section(a.out, "scale:memory", lines)


if __name__ == "__main__":
    main()
