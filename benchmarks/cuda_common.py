"""What the CUDA suites (``python -m benchmarks cuda``: benchmarks/run.py --device cuda;
``python -m benchmarks cuda-memory``: benchmarks/cuda_memory.py) share: whether CUDA can
run here, the device line built on report.py's host and versions, and rows kept across
runs in a JSON file (a GPU machine's command time is limited, so a full table takes
several runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402
from report import host  # noqa: E402


def cuda_unavailable() -> str | None:
    """Why a CUDA benchmark cannot run here, or None."""
    import onnxruntime
    import torch

    if not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a build without CUDA"
        return (
            f"--device cuda: torch {torch.__version__} ({built}) sees no CUDA device "
            f"(torch.cuda.is_available() is False); run it on a GPU machine (see benchmarks/gpu_run.sh)"
        )
    providers = onnxruntime.get_available_providers()
    if "CUDAExecutionProvider" not in providers:
        return (
            f"--device cuda: onnxruntime {onnxruntime.__version__} has no CUDAExecutionProvider "
            f"(available: {providers}); install onnxruntime-gpu (benchmarks/gpu_run.sh installs it)"
        )
    return None


def driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # noqa: BLE001 - NVML missing or refused: try nvidia-smi
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=60,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(torch.cuda.current_device())


def machine() -> str:
    """The device and driver, then report.py's host and versions (torch's CUDA and cuDNN,
    and the model libraries, added), for a results file."""
    import torch

    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    versions = report.versions(
        extra=("onnx-ir", "onnx", "transformers", "timm"),
        torch_detail=f" (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})")
    return (
        f"{p.name} ({p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}, "
        f"{p.multi_processor_count} SMs), driver {driver_version()}; host {host()}; {versions}"
    )


def tf32_line() -> str:
    import torch

    return (
        f"torch.backends.cuda.matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}, "
        f"torch.backends.cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}, "
        f"float32 matmul precision {torch.get_float32_matmul_precision()!r}"
    )


class Rows:
    """Result rows of this run, merged with those an earlier run on the same device kept
    in ``path`` (None: nothing kept). A row is a dict; ``key`` names the fields that
    identify it (a later row with the same key replaces an earlier one)."""

    def __init__(self, path: str | None, device: str, key: tuple[str, ...]):
        self.path, self.device, self.key = path, device, key
        self.earlier: list[dict] = []
        self.runs = 1
        if path and os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
            if data.get("device") == device:
                self.earlier = list(data.get("rows", []))
                self.runs = int(data.get("runs", 1)) + 1
            else:
                print(f"{path} holds rows from {data.get('device')!r}, not {device!r}: not merged", flush=True)
        self.new: list[dict] = []

    def add(self, row: dict) -> None:
        self.new.append(row)
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "w") as f:
                json.dump({"device": self.device, "runs": self.runs, "rows": self.all()}, f, indent=1)

    def all(self, order: dict | None = None) -> list[dict]:
        """Every row, the newest for each key, sorted by ``order`` (field -> list)."""
        by_key = {tuple(r[k] for k in self.key): r for r in self.earlier}
        by_key.update({tuple(r[k] for k in self.key): r for r in self.new})
        rows = list(by_key.values())
        if order:
            def rank(r):
                return tuple(order[k].index(r[k]) if r[k] in order[k] else len(order[k]) for k in order)

            rows.sort(key=rank)
        return rows


def kernel_profile(step, steps: int = 5) -> dict:
    """Where a step's time goes on the GPU: per step, the milliseconds of device work
    (every kernel CUPTI saw, ORT's and cuBLAS's included), of that the copies and fills,
    the number of device activities, and the five longest kernels, from torch.profiler
    over ``steps`` calls after one untraced call. Set against the step's time, a small
    kernel share means the step waits on the host (launches, Python, syncs)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        device = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.self_device_time_total for e in device)
        copies = sum(e.self_device_time_total for e in device if e.key.lower().startswith(("memcpy", "memset")))
        top = sorted(device, key=lambda e: -e.self_device_time_total)[:5]
        return {
            "kernel_ms": total / 1e3 / steps,
            "copy_ms": copies / 1e3 / steps,
            "launches": sum(e.count for e in device) / steps,
            "top": [(e.key[:60], e.self_device_time_total / 1e3 / steps) for e in top],
        }
    except Exception as e:  # noqa: BLE001 - a profile is extra information
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def profile_table(rows: list[dict], backends: list[str]) -> list[str]:
    """Markdown lines of the profiles kept in ``rows`` (row["profile"][backend])."""
    lines = [
        "| model | run | backend | time ms | GPU work ms | of it copies ms | device activities per step | longest kernels (ms per step) |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        for b in backends:
            p = r.get("profile", {}).get(b)
            if not p:
                continue
            t = r["times"].get(b)
            t_ms = f"{t * 1e3:.3f}" if t else "-"
            if "error" in p:
                lines.append(f"| {r['model']} | {r['scenario']} | {b} | {t_ms} | profile failed: {p['error']} | | | |")
                continue
            top = "; ".join(f"{k} {v:.3f}" for k, v in p["top"])
            lines.append(
                f"| {r['model']} | {r['scenario']} | {b} | {t_ms} | {p['kernel_ms']:.3f} | {p['copy_ms']:.3f} "
                f"| {p['launches']:.0f} | {top} |"
            )
    return lines
