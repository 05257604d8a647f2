"""Where sekv keeps its data: ``$SEKV_HOME`` (default ``~/.cache/sekv``)."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import SekvError


def sekv_home() -> Path:
    """The user-data directory; created on first use."""
    home = Path(os.environ.get("SEKV_HOME") or Path.home() / ".cache" / "sekv").expanduser()
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SekvError(
            f"cannot use {home} as sekv's data directory ({exc.strerror or exc}); "
            "set SEKV_HOME to a writable directory"
        ) from None
    return home
