"""What reaches the terminal: text with its control characters escaped, consoles that escape
them in everything they print, and a standard output whose failures are told apart.

A document can hold escape sequences (``ESC[31m`` turns a terminal red; others move the cursor,
retitle the window or rewrite the clipboard). Every line the CLI prints goes through
:func:`printable` or a console from :func:`console`, so they are shown as ``\\x1b[31m`` and never
act. JSON output escapes them itself (``\\u001b``) and stays exact.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from rich.console import Console, ConsoleOptions, RenderableType, RenderHook, RenderResult
from rich.segment import Segment

# C0 controls but tab and newline, DEL, C1 controls, the bidirectional overrides and
# isolates (they reorder the text shown around them), and lone surrogates (what a file name's
# bytes that are not UTF-8 decode to, os.fsdecode: no UTF-8 output can hold them)
SURROGATE = "\ud800-\udfff"
CONTROL = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069{SURROGATE}]")
CONTROL_OR_NEWLINE = re.compile(f"[\n{CONTROL.pattern[1:-1]}]")
SURROGATES = re.compile(f"[{SURROGATE}]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:  # a byte os.fsdecode could not decode: the byte itself
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, newlines: bool = True) -> str:
    """``text`` with its control characters shown as escapes (``\\x1b``); tabs stay, and
    newlines unless ``newlines`` is false (then ``\\x0a``: one line whatever the text). A
    file name's bytes that are not UTF-8 show as ``\\xe9``."""
    return (CONTROL if newlines else CONTROL_OR_NEWLINE).sub(_escaped, text)


def one_line(name: object) -> str:
    """A file name, path or other name as :func:`printable` shows it on one line (a newline in
    it as ``\\x0a``): a listing keeps one line per entry whatever the names hold."""
    return printable(str(name), newlines=False)


def encodable(text: str) -> str:
    """``text`` that UTF-8 can hold: a file name's bytes that are not UTF-8 shown as
    ``\\xe9`` (as :func:`printable` shows them), everything else as it is."""
    return SURROGATES.sub(_escaped, text)


class Escaped:
    """A renderable printed with the control characters of its text escaped (the styles the
    console adds, and control segments such as a progress bar's cursor moves, are kept)."""

    def __init__(self, renderable: RenderableType) -> None:
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for segment in console.render(self.renderable, options):
            if segment.control or not CONTROL.search(segment.text):
                yield segment
            else:
                yield Segment(printable(segment.text), segment.style)


class EscapeControls(RenderHook):
    """A render hook: everything a console prints goes through :class:`Escaped`."""

    def process_renderables(self, renderables: list) -> list:
        return [Escaped(r) for r in renderables]


def console(**kwargs: Any) -> Console:
    """A Rich console (``kwargs`` as for ``Console``) that escapes control characters in all
    it prints."""
    made = Console(**kwargs)
    made.push_render_hook(EscapeControls())
    return made


err = console(stderr=True)  # progress, warnings and notices: stderr, never the data
log = console(stderr=True, markup=False, highlight=False, soft_wrap=True)  # plain text lines


class OutputClosed(Exception):
    """Standard output's reader went away (``sekv … | head -1``): stop quietly."""


class OutputFailed(Exception):
    """Standard output cannot be written (a full disk, an I/O error): ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class GuardedOutput:
    """Standard output whose write and flush failures raise :class:`OutputClosed` (the pipe's
    reader left) or :class:`OutputFailed`, which no handler of ``OSError`` takes for its own."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self.stream, name)(*args)
        except BrokenPipeError:
            raise OutputClosed() from None
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                raise OutputClosed() from None
            raise OutputFailed(exc.strerror or str(exc)) from None

    def write(self, text: str) -> int:
        return self._call("write", text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._call("flush")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextmanager
def guarded_stdout() -> Iterator[None]:
    """Standard output as a :class:`GuardedOutput` for the block (what is written in it is
    flushed before it ends: a full disk is told here, not at the interpreter's exit)."""
    stream = sys.stdout
    sys.stdout = GuardedOutput(stream)  # type: ignore[assignment]
    try:
        yield
        sys.stdout.flush()
    finally:
        sys.stdout = stream


def drop_output() -> None:
    """Point file descriptor 1 at /dev/null, so that what is left in stdout's buffer goes
    nowhere at exit instead of failing again (nothing to do where stdout has no descriptor)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
