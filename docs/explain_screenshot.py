"""Makes docs/explain.png, the picture of ``ExplainReport.save_html`` on the documentation
site's explain page (docs/explain.md): one training step of a ResNet-18 (timm, random weights, batch 8 of 64x64 images) through
lort with executor="ort" (every group in ORT, so the picture shows the partition;
executor="auto" may run a whole graph eagerly, drawn as one grey box), rendered by
headless Chromium (Debian: apt-get install chromium) and reduced to a 256-colour PNG.
The times on it are those of the run that made it.

    python docs/explain_screenshot.py [out.png]     # LORT_SCREENSHOT_HTML=x.html keeps the page
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import torch

import lort
from lort.testing.models import CASES, make_torchvision_importable


def main(out: str) -> None:
    make_torchvision_importable()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("chromium is not installed (Debian: apt-get install chromium)")
    model, args = CASES["resnet18"].make(batch=8)
    report = lort.explain(model, *args)
    keep = os.environ.get("LORT_SCREENSHOT_HTML")
    if keep:
        report.save_html(keep)
    with tempfile.TemporaryDirectory() as tmp:
        page = report.save_html(os.path.join(tmp, "lort.html"))
        png = os.path.join(tmp, "shot.png")
        subprocess.run(
            [
                chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={os.path.join(tmp, 'profile')}", f"--screenshot={png}",
                "--window-size=1400,1350", f"file://{os.path.abspath(page)}",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        from PIL import Image

        Image.open(png).convert("RGB").quantize(256).save(out, optimize=True)
    print(f"{out}: {os.path.getsize(out)} bytes")


if __name__ == "__main__":
    os.environ.setdefault("LORT_EXECUTOR", "ort")  # read when lort.explain makes its backend
    os.environ.setdefault("LORT_DISK_CACHE", "0")
    torch.manual_seed(0)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "explain.png"))
