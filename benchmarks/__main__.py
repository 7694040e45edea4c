"""The benchmarks' one entry point, run from the repository root:

    python -m benchmarks --list              every suite, what it measures, its results file
    python -m benchmarks SUITE [args ...]    run that suite (``SUITE --help``: its options)

A suite is a script in benchmarks/ run in a subprocess with this interpreter, the
arguments passed on and its exit status returned. Each writes its tables, with the date,
machine and command above them, to benchmarks/results/; ``charts`` draws the PNGs of
benchmarks/results/charts/ from those tables. One-off studies are scripts of their own in
benchmarks/studies/ (listed in benchmarks/studies/README.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


class Suite:
    def __init__(self, name: str, script: str, measures: str, results: list[str], args: tuple[str, ...] = ()):
        self.name, self.script, self.measures, self.results, self.args = name, script, measures, results, args


#: Every suite: its name, script (in benchmarks/), what it measures, its results files
#: (in benchmarks/), and arguments put before the user's.
SUITES = [
    Suite("speed", "run.py", "eager vs inductor vs lort (torch.compile and ORTModule) vs the model whole in ORT: "
          "inference at batch 1 and 8 and a training step, 10 models, on CPU; `make bench` runs it",
          ["results/speed.md"]),
    Suite("training", "engines.py", "training steps at real sizes (BERT-base, GPT-2 small, ResNet-50, ViT-S/16) "
          "with inductor as lort's third engine, both front ends beside eager and inductor", ["results/training.md"]),
    Suite("batched", "batched.py", "batched inference at real sizes (BERT-base, GPT-2 small, ViT-S/16, "
          "ResNet-50): eager, inductor, lort through both front ends and the whole model in ORT, after lort's "
          "engines are chosen", ["results/batched_inference.md"]),
    Suite("scale", "scale.py", "BERT-base, GPT-2 small and a 3.7 GB decoder: first call, peak and resident RSS "
          "(--speed: training steps interleaved with eager)", ["results/scale.md"]),
    Suite("first-call", "first_call.py", "first call in a fresh process, cold and with the disk cache warm, "
          "against inductor's", ["results/first_call.md"]),
    Suite("generation", "generate.py", "greedy generate() through each front end: first generate, ms per token, "
          "same tokens as eager", ["results/generation.md"]),
    Suite("quantized-decoding", "quantized_decoding.py", "greedy decoding with int8 and int4 weights "
          "(Options.quantize) against float32: ms per token, first generate, RSS, logits error, same tokens",
          ["results/quantized_decoding.md"]),
    Suite("quantized-encoder", "quantized_encoder.py", "BERT-base inference with 8-bit dynamic quantization "
          "(Options.quantize='int8_dynamic') against eager, PyTorch's dynamic quantization, torchao and lort "
          "float32", ["results/quantized_decoding.md"]),
    Suite("engine-limit", "engine_limit.py", "CNN and vision-transformer families against the whole model in one "
          "ORT session, spinning off and on (writes results/engine_limit_run.md)", ["results/engine_limit.md"]),
    Suite("memory", "memory.py", "peak and steady RSS of 20 training steps, eager vs inductor vs lort",
          ["results/memory.md"]),
    Suite("frozen-memory", "freeze_memory.py", "peak RSS of inference with frozen weights against eager and the "
          "whole model in ORT (--sizes cuda: the larger models)",
          ["results/frozen_memory.md", "results/frozen_memory_large.md"]),
    Suite("conformance", "conformance.py", "PyTorch's OpInfo suite through lort: right, fell back, share of nodes "
          "in ORT (`make conformance`)", ["results/conformance.md"]),
    Suite("cuda", "run.py", "the speed suite on a CUDA device (issue 10's sizes; benchmarks/gpu_run.sh runs it "
          "on a GPU machine)", ["results/cuda.md"], ("--device", "cuda")),
    Suite("cuda-memory", "cuda_memory.py", "peak GPU memory of training steps, lort against eager",
          ["results/cuda_memory.md"]),
    Suite("charts", "charts.py", "the PNG charts drawn from the results tables (no benchmark is run)",
          ["results/charts/headline.png", "results/charts/speed.png", "results/charts/training.png",
           "results/charts/memory.png"]),
]
BY_NAME = {s.name: s for s in SUITES}


def listing() -> str:
    width = max(len(s.name) for s in SUITES)
    lines = ["Suites (python -m benchmarks SUITE [args]; SUITE --help for its options):", ""]
    for s in SUITES:
        script = " ".join([f"benchmarks/{s.script}", *s.args])
        lines.append(f"  {s.name:<{width}}  {s.measures}")
        lines.append(f"  {'':<{width}}  script: {script}; results: {', '.join('benchmarks/' + r for r in s.results)}")
    lines += ["", "One-off studies: benchmarks/studies/README.md (each runs as python benchmarks/studies/NAME.py)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("--list", "-l", "--help", "-h", "list"):
        print(__doc__.strip() + "\n\n" + listing())
        return 0
    name, args = argv[0], argv[1:]
    suite = BY_NAME.get(name)
    if suite is None:
        print(f"unknown suite {name!r}; choose from {', '.join(BY_NAME)} (python -m benchmarks --list)",
              file=sys.stderr)
        return 2
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, suite.script), *suite.args, *args])
    while True:
        try:
            rc = proc.wait()
            break
        except KeyboardInterrupt:  # the suite, in our process group, got it too: let it finish its way
            continue
    # A suite killed by a signal: the shell's status for it (128 + the signal).
    return 128 - rc if rc < 0 else rc


if __name__ == "__main__":
    sys.exit(main())
