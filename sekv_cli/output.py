"""What a command writes: data on stdout (JSON, an answer's text as it is decoded, when its
first text came) and output files (checked before the work, written whole or into a stream)."""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sekv_core.errors import SekvError

from .terminal import encodable, printable


def print_json(data: dict[str, Any]) -> None:
    """``data`` as indented JSON on stdout. A file name's bytes that are not UTF-8 (lone
    surrogates in Python's string, which strict JSON readers refuse) are written as ``\\xe9``,
    as the terminal shows them."""
    text = json.dumps(data, indent=2, default=str)
    if "\\ud" in text:  # perhaps a lone surrogate (or a pair: an emoji, left as it is)
        text = json.dumps(_encodable(data), indent=2, default=lambda o: encodable(str(o)))
    sys.stdout.write(text + "\n")


def _encodable(data: Any) -> Any:
    """``data`` with every string in it (keys too) as :func:`encodable` makes it."""
    if isinstance(data, str):
        return encodable(data)
    if isinstance(data, dict):
        return {_encodable(k): _encodable(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_encodable(v) for v in data]
    return data


def seconds_since_start() -> float | None:
    """Seconds since this process started, interpreter start-up included (Linux: from
    /proc, to a clock tick; None where that cannot be read)."""
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22: starttime
        return max(uptime - ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


class FirstText:
    """An ``on_text`` for an answer: hands each delta to ``show`` (None: nowhere) and notes,
    in ``after_start``, how long after the process started the first one came."""

    def __init__(self, show: Callable[[str], None] | None) -> None:
        self.show = show
        self.after_start: float | None = None

    def __call__(self, delta: str) -> None:
        if self.after_start is None:
            since = seconds_since_start()
            self.after_start = None if since is None else round(since, 3)
        if self.show is not None:
            self.show(delta)


def stream_text(delta: str) -> None:
    """Write an answer's text as it is decoded (control characters escaped)."""
    sys.stdout.write(printable(delta))
    sys.stdout.flush()


def check_writable(path: Path, inputs: Sequence[Path] = ()) -> None:
    """Fail before the (slow) model work if ``path`` cannot be written, or is one of the
    ``inputs`` (the same file by any name: a hard link or a symlink to it) or a document inside
    a folder among them: no command writes over what it reads."""
    for given in inputs:
        if given.is_dir() and _document_inside(path, given):
            raise SekvError(
                f"cannot write '{path}': it is a document of the input folder '{given}'; "
                "pass a file name outside it"
            )
        if _same_file(path, given):
            link = "" if path.resolve() == given.resolve() else " (the same file by a link)"
            raise SekvError(
                f"cannot write '{path}': it is the input document '{given}'{link}; "
                "pass another file name"
            )
    if path.is_dir():
        raise SekvError(f"cannot write '{path}': it is a directory; pass a file name")
    if written_as_stream(path):
        if not os.access(path, os.W_OK):
            raise SekvError(f"cannot write '{path}': permission denied")
        return
    parent = Path(os.path.realpath(path)).parent  # a link's file is written, the link kept
    if not parent.is_dir():
        raise SekvError(f"cannot write '{path}': no such directory '{parent}'")
    if not os.access(parent, os.W_OK):
        raise SekvError(f"cannot write '{path}': permission denied")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # either is missing: a new file is no input
        return False


def _document_inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is an existing document (.pdf, .txt, .md) somewhere under ``folder``."""
    from sekv_core.documents import SUPPORTED_SUFFIXES

    if not path.is_file() or path.suffix.lower() not in SUPPORTED_SUFFIXES:
        return False
    return path.resolve().is_relative_to(folder.resolve())


def written_as_stream(path: Path) -> bool:
    """Whether an output file ``path`` is written into as it is rather than replaced: it is
    there and not a regular file (a device such as ``/dev/null``, a FIFO, a socket), or it
    leads through links to an open file of a process in ``/proc`` (``/dev/stdout``:
    the bytes must go to that descriptor, not to a new file of its name)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return True
    except OSError:  # not there (or a dangling link): a new file
        return False
    hop = os.path.abspath(path)
    for _ in range(40):  # the kernel's limit on links followed
        if Path(os.path.realpath(os.path.dirname(hop))).is_relative_to("/proc"):
            return True
        if not os.path.islink(hop):
            return False
        hop = os.path.join(os.path.dirname(hop), os.readlink(hop))
    return False


def write_output(path: Path, content: str) -> None:
    """Write ``content`` to the output file ``path`` (UTF-8; a file name's bytes that are not
    UTF-8 as ``\\xe9``). A regular file, or a new one, is written whole or not at all: via a
    temporary sibling and a rename, with the permissions the user's umask gives a new file;
    a link keeps pointing at it. A device, a FIFO or a process's open file
    (:func:`written_as_stream`) is opened and written into, never replaced."""
    data = encodable(content).encode("utf-8")
    if written_as_stream(path):
        try:
            with open(path, "wb") as f:
                f.write(data)
        except OSError as exc:
            raise SekvError(f"cannot write '{path}': {exc.strerror or exc}") from exc
        return
    target = Path(os.path.realpath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise SekvError(f"cannot write '{path}': {exc.strerror or exc}") from exc
    umask = os.umask(0)
    os.umask(umask)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise SekvError(f"cannot write '{path}': {exc.strerror or exc}") from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
