"""One builder per store, and the leftovers of writers that died (a store's, or a converted
model's: :func:`sekv_core.models.converted_gguf` writes it as a store is written).

Every store build holds an exclusive lock on ``$SEKV_HOME/locks/<key>.lock`` (:func:`store_lock`,
``fcntl.flock``: the kernel releases it when its holder dies, even by ``kill -9``); a second
process that wants the store waits for it, then loads what the first built. Lock files stay
out of ``stores/``, which holds only stores and their work folders.

A killed writer leaves folders beside the stores (:func:`clean_leftovers` removes them at the
next build):

- ``.tmp-<key>-*`` — a store being written (:func:`sekv_core.store.write.write_atomically`), which
  records its writer's pid and host in ``.writer`` (:func:`mark_writer`): removed once that
  process is gone;
- ``.trash-<key>-<pid>`` — a replaced store being deleted: removed once that process is gone;
- ``.partial-<key>`` — a streamed build's checkpoints (:mod:`sekv_core.store.checkpoint`), removed
  once no process holds its store's lock, unless a rerun can still resume it: its checkpoint is
  intact and its store is not built yet, for at most PARTIAL_KEEP_S (the build of ``<key>``
  itself resumes it or starts over, as :class:`~sekv_core.store.stream.StreamBuilder` decides).

Where ``fcntl`` is missing (Windows) locks are no-ops.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no locks
    fcntl = None  # type: ignore[assignment]

WRITER = ".writer"  # inside a .tmp-* folder: {"pid", "host"} of the process writing it
UNMARKED_GRACE_S = 600.0  # a .tmp-* folder without WRITER (created, not marked yet)
PARTIAL_KEEP_S = 7 * 86400.0  # an intact checkpoint of another document waits this long
STATE_VERSION = 6  # of a streamed build's checkpoints (sekv_core.store.checkpoint): a build
# never resumes another version's
WORK_PREFIXES = (".tmp-", ".trash-", ".partial-")


def lock_file(store: Path) -> Path:
    """The lock file of the store directory ``store`` (``stores/../locks/<key>.lock``)."""
    return store.parent.parent / "locks" / f"{store.name}.lock"


@contextmanager
def store_lock(store: Path, waiting: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the build lock of ``store``; while another process holds it, call ``waiting``
    once and block until it is released."""
    with _locked(lock_file(store), wait=True, waiting=waiting):
        yield


@contextmanager
def _locked(path: Path, wait: bool, waiting: Callable[[], None] | None = None) -> Iterator[bool]:
    """Lock ``path`` exclusively; yields False (without waiting) when ``wait`` is False and
    another process holds it."""
    if fcntl is None:
        yield True
        return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            if waiting:
                waiting()
            fcntl.flock(f, fcntl.LOCK_EX)
        yield True


def mark_writer(folder: Path) -> None:
    """Record in ``folder`` that this process (pid, host) is writing it."""
    (folder / WRITER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))


def writer_alive(folder: Path) -> bool:
    """Whether the process that marked ``folder`` may still be writing it (another host's: it
    cannot be told, so yes; unmarked: only within UNMARKED_GRACE_S of its last change)."""
    try:
        writer = json.loads((folder / WRITER).read_text())
        pid, host = int(writer["pid"]), str(writer["host"])
    except (OSError, ValueError, KeyError, TypeError):  # unmarked, or a damaged mark: its age
        return _age(folder) < UNMARKED_GRACE_S
    return host != socket.gethostname() or pid_alive(pid)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def clean_leftovers(stores: Path, building: Path, state_version: int) -> list[Path]:
    """Remove what dead writers left in ``stores`` (see the module docstring); the work folder
    of ``building`` (the store this process is about to build) is left to its builder, and
    checkpoints of another ``state_version`` (:data:`STATE_VERSION`) are never
    resumed. Returns what was removed."""
    removed = []
    with suppress(FileNotFoundError):
        for entry in sorted(stores.iterdir()):
            if not entry.is_dir() or entry.is_symlink():
                continue
            try:
                leftover = _is_leftover(entry, building, state_version)
            except OSError:  # removed meanwhile (by another cleaner, or its finished writer)
                continue
            if leftover:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def _is_leftover(entry: Path, building: Path, state_version: int) -> bool:
    name = entry.name
    if name.startswith(".tmp-"):
        return not writer_alive(entry)
    if name.startswith(".trash-"):
        pid = name.rsplit("-", 1)[-1]
        return not (pid.isdigit() and pid_alive(int(pid)))
    if name.startswith(".partial-"):
        store = entry.with_name(name.removeprefix(".partial-"))
        return store != building and _partial_abandoned(entry, store, state_version)
    return False


def _partial_abandoned(work: Path, store: Path, state_version: int) -> bool:
    """Whether no process builds ``store`` from ``work`` and no rerun will resume it."""
    with _locked(lock_file(store), wait=False) as free:
        if not free:
            return False
        if (store / "manifest.json").exists():  # built (the process died before cleaning up)
            return True
        return (
            not resumable(work, store.name, state_version)
            or _age(work / "state.json") > PARTIAL_KEEP_S
        )


def work_folder_state(entry: Path) -> str | None:
    """What the work folder ``entry`` is: ``resumable`` (an interrupted streamed build a rerun
    continues), ``leftover`` (a dead writer's), or None while its process still works in it."""
    name = entry.name
    if name.startswith(".partial-"):
        store = entry.with_name(name.removeprefix(".partial-"))
        with _locked(lock_file(store), wait=False) as free:
            if not free:
                return None
        resumes = resumable(entry, store.name, STATE_VERSION) and not store.exists()
        return "resumable" if resumes else "leftover"
    return "leftover" if _is_leftover(entry, entry, STATE_VERSION) else None


def resumable(work: Path, store: str, state_version: int) -> bool:
    """Whether ``work`` holds an intact-looking checkpoint of ``store`` (its record readable,
    of ``state_version``, every file it lists present; checksums are verified by the build that
    resumes it)."""
    try:
        record = json.loads((work / "state.json").read_text())
        files = [*record["parts"], record["tensors"]]
        ok = record.get("version") == state_version and record.get("store") == store
        return ok and all((work / f["name"]).is_file() for f in files)
    except (OSError, ValueError, KeyError, TypeError):
        return False
