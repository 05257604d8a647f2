"""Where sekv keeps its data: ``$SEKV_HOME`` (default ``~/.cache/sekv``)."""

from __future__ import annotations

import os
from pathlib import Path


def sekv_home() -> Path:
    """The user-data directory; created on first use."""
    home = Path(os.environ.get("SEKV_HOME") or Path.home() / ".cache" / "sekv").expanduser()
    home.mkdir(parents=True, exist_ok=True)
    return home
