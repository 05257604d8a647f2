"""Render `sekv inspect --html` for a document and screenshot it with headless Chromium.

    python scripts/screenshot_inspect.py [DOC] [--out docs/inspect.png] [--model M]

Needs Chromium (Debian: ``apt-get install -y chromium``). Runs the real default model unless
``--model`` is given; ``$SEKV_HOME`` picks the store cache as usual.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if found := shutil.which(name):
            return found
    return None


def screenshot(html: Path, png: Path, size: str = "1400,1800", timeout: float = 120) -> None:
    """Headless Chromium screenshot of a local HTML file (no network, throwaway profile)."""
    chromium = find_chromium()
    if chromium is None:
        raise SystemExit("chromium not found; install it (apt-get install -y chromium)")
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sekv-chromium-") as profile:
        subprocess.run(
            [
                chromium,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={size}",
                f"--screenshot={png.resolve()}",
                html.resolve().as_uri(),
            ],
            check=True,
            timeout=timeout,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("doc", nargs="?", default=str(ROOT / "sample_docs" / "lighthouse.md"))
    parser.add_argument("--out", default=str(ROOT / "docs" / "inspect.png"))
    parser.add_argument("--model", default=None)
    parser.add_argument("--size", default="1400,1800", help="window WIDTH,HEIGHT in pixels")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sekv-inspect-") as tmp:
        html = Path(tmp) / "inspect.html"
        cmd = [sys.executable, "-m", "sekv_cli", "inspect", args.doc, "--html", str(html)]
        if args.model:
            cmd += ["--model", args.model]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        screenshot(html, Path(args.out), args.size)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
