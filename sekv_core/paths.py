"""Where sekv keeps its data: ``$SEKV_HOME`` (default ``~/.cache/sekv``), its stores in
``stores/`` (0700)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from .errors import SekvError


def home_path() -> Path:
    """Where the user-data directory is (``$SEKV_HOME``, default ``~/.cache/sekv``); not
    created here."""
    return Path(os.environ.get("SEKV_HOME") or Path.home() / ".cache" / "sekv").expanduser()


def sekv_home() -> Path:
    """The user-data directory; created on first use."""
    home = home_path()
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SekvError(
            f"cannot use {home} as sekv's data directory ({exc.strerror or exc}); "
            "set SEKV_HOME to a writable directory"
        ) from None
    return home


def stores_dir() -> Path:
    """``$SEKV_HOME/stores``, private to the user (0700: stores hold whole documents)."""
    stores = sekv_home() / "stores"
    try:
        private_dir(stores)
    except OSError as exc:
        raise SekvError(
            f"cannot use {stores} for span stores ({exc.strerror or exc}); "
            "set SEKV_HOME to a writable directory"
        ) from None
    return stores


def private_dir(path: Path) -> Path:
    """``path`` as a directory only its user reads (0700), created with its parents if need be;
    one made by an older sekv or under a wide umask is tightened."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


def is_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk is full: an OSError ENOSPC (or EDQUOT), or safetensors'
    own error, which carries the OS error only in its text."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "os error 28" in str(exc) or "No space left on device" in str(exc)


def no_space_error(folder: Path, needed: int, what: str) -> SekvError:
    """The error for a disk too full to write ``needed`` bytes into ``folder`` for ``what``
    (``"to convert the default model"``): how much to free there."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = 0
    short = max(needed - free, 1 << 20)
    return SekvError(
        f"no space left on {folder} {what}: free {short / 2**20:,.0f} MiB there (it needs "
        f"about {needed / 2**20:,.0f} MiB, {free / 2**20:,.0f} MiB are free), or set SEKV_HOME "
        "to a disk with room"
    )
