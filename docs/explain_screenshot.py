"""Makes docs/explain.png, the README's picture of ``ExplainReport.save_html``: one
training step of a ResNet-18 (timm, random weights) through lort with default options,
rendered by headless Chromium (Debian: apt-get install chromium) and reduced to a
256-colour PNG.

    python docs/explain_screenshot.py [out.png]
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
    with tempfile.TemporaryDirectory() as tmp:
        page = report.save_html(os.path.join(tmp, "lort.html"))
        png = os.path.join(tmp, "shot.png")
        subprocess.run(
            [
                chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={os.path.join(tmp, 'profile')}", f"--screenshot={png}",
                "--window-size=1400,1000", f"file://{os.path.abspath(page)}",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        from PIL import Image

        Image.open(png).convert("RGB").quantize(256).save(out, optimize=True)
    print(f"{out}: {os.path.getsize(out)} bytes")


if __name__ == "__main__":
    torch.manual_seed(0)
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "explain.png"))
