"""The docs' screenshots: `sekv inspect --html` and `sekv ask --html` (the answer view) of a
document, rendered by headless Chromium.

    python scripts/screenshots.py [DOC] [--question Q] [--out docs] [--model M]

writes OUT/inspect.png and OUT/answer.png. Needs Chromium (Debian: ``apt-get install -y
chromium``). Runs the real default model unless ``--model`` is given; ``$SEKV_HOME`` picks the
store cache as usual.
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


def screenshot(html: Path, png: Path, size: str = "1200,1400", timeout: float = 120) -> None:
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
    parser.add_argument("doc", nargs="?", default=str(ROOT / "sample_docs" / "handbook.pdf"))
    parser.add_argument("--question", default="Who is the head of the Security team?")
    parser.add_argument("--out", default=str(ROOT / "docs"))
    parser.add_argument("--model", default=None)
    parser.add_argument("--size", default="1200,1400", help="window WIDTH,HEIGHT in pixels")
    args = parser.parse_args()
    model = ["--model", args.model] if args.model else []
    pages = {
        "inspect": ["inspect", args.doc],
        "answer": ["ask", args.doc, args.question],
    }
    with tempfile.TemporaryDirectory(prefix="sekv-screenshots-") as tmp:
        for name, command in pages.items():
            html = Path(tmp) / f"{name}.html"
            cmd = [sys.executable, "-m", "sekv_cli", *command, "--html", str(html), *model]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            png = Path(args.out) / f"{name}.png"
            screenshot(html, png, args.size)
            print(f"wrote {png}")


if __name__ == "__main__":
    main()
