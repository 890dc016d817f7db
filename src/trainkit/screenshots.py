"""``make screenshots``: PNGs of TensorBoard's scalars, images and hparams pages, taken with
headless Chromium from a real ``tensorboard`` server. Without Chromium it says so and skips."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from trainkit.runtime import free_port

PAGES = ("scalars", "images", "hparams")
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    explicit = os.environ.get("CHROMIUM")
    return explicit or next((path for b in BROWSERS if (path := shutil.which(b))), None)


def serve(logdir: Path, port: int) -> subprocess.Popen:
    """A tensorboard server, returned once it answers with at least one run."""
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir)),
            *("--host", "127.0.0.1", "--port", str(port), "--load_fast=false"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(120):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=5) as r:
                if json.loads(r.read()):
                    return server
        except OSError:
            pass
        if server.poll() is not None:
            break
        time.sleep(0.5)
    server.terminate()
    raise RuntimeError(f"tensorboard --logdir {logdir} did not come up with any run")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--logdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    chromium = find_chromium()
    if chromium is None:
        print("screenshots skipped: no Chromium found (install chromium, or set CHROMIUM=<path>)")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = serve(args.logdir, port)
    try:
        for page in PAGES:
            target = args.out / f"{page}.png"
            subprocess.run(
                [
                    *(chromium, "--headless=new", "--disable-gpu", "--no-sandbox"),
                    *(
                        "--hide-scrollbars",
                        "--window-size=1400,1000",
                        "--virtual-time-budget=15000",
                    ),
                    *(f"--screenshot={target}", f"http://127.0.0.1:{port}/#{page}"),
                ],
                check=True,
                capture_output=True,
                timeout=120,
            )
            print(f"wrote {target}")
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
