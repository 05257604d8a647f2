"""Where sekv keeps its data: ``$SEKV_HOME`` (default ``~/.cache/sekv``), its stores in
``stores/`` (0700), or in ``$SEKV_STORES`` where that is set (a folder machines share).

A home that cannot be written (a shared cache mounted read-only, or one this user may not
write: :func:`home_read_only`) is used as it is: what it holds answers, nothing is written
there (no lock file, no last-use time, no index update); work that must write there is a
SekvError (:func:`read_only_error`).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
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


def read_only(folder: Path) -> bool:
    """Whether ``folder`` cannot be written: its file system is mounted read-only, or this
    user may not write it."""
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return True
    except (OSError, AttributeError):  # AttributeError: no statvfs (Windows)
        pass
    return not os.access(folder, os.W_OK | os.X_OK)


def home_read_only() -> bool:
    """Whether ``$SEKV_HOME`` exists and cannot be written (see the module docstring)."""
    home = home_path()
    return home.is_dir() and read_only(home)


def check_home(answering: bool = False) -> None:
    """Fail before the model loads if ``$SEKV_HOME`` (stores, routers, the default model's
    converted copy) cannot be written, rather than after a prefill. ``answering``: a read-only
    home that holds stores (a shared cache) is used as it is (see the module docstring: work
    that must write there fails when it comes to it)."""
    home = sekv_home()  # created if need be, else an error naming SEKV_HOME
    if answering and home_read_only() and _holds_stores(home):
        return
    for folder in (home, home / "stores"):
        try:
            if folder.is_dir():
                with tempfile.TemporaryFile(dir=folder):  # what os.access misses: root, read-only
                    pass
        except OSError:
            where = "" if folder == home else f" ({folder})"
            raise SekvError(
                f"SEKV_HOME {home} is not writable{where}; set SEKV_HOME to a writable directory"
            ) from None


def _holds_stores(home: Path) -> bool:
    try:
        return any((home / "stores").iterdir())
    except OSError:
        return False


ASK_WHAT_IT_HOLDS = (
    "ask about documents it holds the stores of, or set SEKV_HOME to a writable directory"
)


def read_only_error(what: str, fix: str = ASK_WHAT_IT_HOLDS) -> SekvError:
    """The error for work that must write in a read-only ``$SEKV_HOME``: ``what`` cannot be
    done (``"it holds no span store of a.md, and one cannot be built there"``), and ``fix``."""
    return SekvError(f"$SEKV_HOME {home_path()} is read-only: {what}; {fix}")


STORES_ENV = "SEKV_STORES"  # a store folder apart from the home (one several machines share)


def stores_path() -> Path:
    """Where span stores are: ``$SEKV_STORES`` (absolute), else ``$SEKV_HOME/stores``; not
    created here."""
    named = os.environ.get(STORES_ENV)
    return Path(named).expanduser().absolute() if named else home_path() / "stores"


def stores_dir() -> Path:
    """:func:`stores_path`, private to the user (0700: stores hold whole documents); in a
    read-only home, as it is."""
    sekv_home()  # an unusable home is the error, even with the stores elsewhere
    stores = stores_path()
    if home_read_only():
        return stores
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
