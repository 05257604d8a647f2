"""Shared CLI plumbing: the stderr console, error handling, cheap checks, model loading with a
spinner, prefill progress.

Text from documents, files and the user reaches the terminal as Rich ``Text``, never as markup,
and with its control characters escaped (:mod:`sekv_cli.terminal`).
"""

from __future__ import annotations

import functools
import json
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, TypeVar

import typer
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from sekv_core.config import (
    DEFAULT_BUDGET,
    MAX_TOKENS,
    MethodSettings,
    StoreSettings,
)
from sekv_core.errors import SekvError
from sekv_core.method_names import USER_METHODS
from sekv_core.paths import home_read_only, sekv_home
from sekv_core.threads import THREADS_ENV, apply_threads, default_threads

from .eta import Eta, ProgressLog, counted, eta_text
from .terminal import (
    OutputClosed,
    OutputFailed,
    console,
    drop_output,
    encodable,
    guarded_stdout,
    one_line,
    printable,
)

err = console(stderr=True)
log = console(stderr=True, markup=False, highlight=False, soft_wrap=True)  # plain text lines
HELP_SETTINGS = {"help_option_names": ["--help", "-h"]}  # Typer context_settings: -h too

MODEL_OPTION = typer.Option(
    None,
    "--model",
    "-m",
    help="Hugging Face id, local directory or .gguf file (default: embedded SmolLM2).",
)
JSON_OPTION = typer.Option(False, "--json", help="Print one JSON object on stdout.")
THREADS_OPTION = typer.Option(
    None,
    "--threads",
    min=1,
    help=f"CPU threads torch uses (default: ${THREADS_ENV}, else $OMP_NUM_THREADS, "
    f"else {default_threads()} here).",
)
MethodName = Literal[USER_METHODS]  # a Choice: any other name is a usage error naming these
METHOD_OPTION = typer.Option(
    "sekv",
    "--method",
    help="How the document is held: sekv (the span store, zooming in), full (the whole KV "
    "cache) or retrieve (BM25 passages filling the window). Baselines: `sekv bench`.",
)
BUDGET_OPTION = typer.Option(
    None,
    "--budget",
    min=1,
    help=f"Tokens reconstructed per layer and KV head when zooming (sekv only; default "
    f"{DEFAULT_BUDGET}; a book reads this many tokens of passages, default "
    f"{MethodSettings().passages}).",
)
MAX_TOKENS_OPTION = typer.Option(
    MAX_TOKENS,
    "--max-tokens",
    min=1,
    help="Refuse a document of more tokens than this unless its store is built already (a "
    "streamed ingest reads ~100-200 tokens/s on a CPU); a file too big for that many tokens is "
    "refused before it is read.",
)


F = TypeVar("F", bound=Callable[..., Any])


PIPE_CLOSED_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a reader that left early


def fail(message: str) -> None:
    """Print ``Error: message`` on stderr (one line, control characters escaped) and exit 1."""
    typer.echo(f"Error: {printable(message, newlines=False)}", err=True)
    raise typer.Exit(1)


def handle_errors(fn: F) -> F:
    """Turn SekvError (and Ctrl-C) into a one-line error and an exit code. Standard output is
    guarded while the command runs: a full one (``> /dev/full``) is one error line, a closed
    pipe (``| head -1``) ends the command quietly with exit code 141."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with guarded_stdout():
                return fn(*args, **kwargs)
        except SekvError as exc:
            fail(str(exc))
        except OutputClosed:
            drop_output()
            raise typer.Exit(PIPE_CLOSED_EXIT) from None
        except OutputFailed as exc:
            drop_output()
            fail(f"cannot write to standard output: {exc.reason}")
        except KeyboardInterrupt:
            typer.echo("Interrupted.", err=True)
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def check_budget(method: str, budget: int | None) -> None:
    """A usage error for ``--budget`` with a method that does not zoom."""
    if budget is not None and method != "sekv":
        raise typer.BadParameter(
            f"it applies to --method sekv only; {method} does not zoom", param_hint="--budget"
        )


def warn(message: str) -> None:
    """``Warning: message`` on stderr, the message as plain text, one line however long."""
    err.print(Text("Warning: ", style="yellow") + Text(printable(message, False)), soft_wrap=True)


def load_model_quietly(name: str | None, threads: int):
    """Set torch's CPU threads, then load the model with a spinner on stderr. Slow work it
    tells of (the default model's first conversion) shows in the spinner, or as a plain line
    where stderr is not a terminal."""
    from sekv_core.models import load_model

    apply_threads(threads)
    with err.status(Text(f"Loading {name or 'the default model'}…")) as status:

        def notice(message: str) -> None:
            if err.is_terminal:
                status.update(Text(f"{message}…"))
            else:
                err.print(Text(f"{message}…"), soft_wrap=True)

        return load_model(name, notice=notice)


class TokenCount(ProgressColumn):
    """done/total tokens, tokens per second over the last half minute (the task's ``unit``
    field, if any, names what is counted instead: ``characters`` while tokenizing)."""

    def render(self, task: Task) -> Text:
        unit = task.fields.get("unit", "tokens")
        if unit in ("characters", "bytes"):
            speed = f"{task.speed / 1e6:,.1f}M/s" if task.speed else "–/s"
        else:
            speed = f"{task.speed:,.0f} tok/s" if task.speed else "– tok/s"
        shown = counted(task.completed, task.total, unit)
        return Text(f"{shown}  {speed}", style="progress.data.speed")


class EtaColumn(ProgressColumn):
    """Time left as :class:`sekv_cli.eta.Eta` fits it (the task's ``eta`` field; ``≥`` before
    it where the ``eta_at_least`` field says it is a lower bound)."""

    def render(self, task: Task) -> Text:
        left = task.fields.get("eta")
        shown = (
            "-:--:--" if left is None else eta_text(left, task.fields.get("eta_at_least", False))
        )
        return Text(shown, style="progress.remaining")


TOKENIZING = "characters"  # the unit of progress while a document is tokenised
ANNOUNCED_TOKENS = 1 << 14  # a prefill this long takes minutes: its log says so when it starts


@contextmanager
def prefill_progress(label: str) -> Iterator[Callable[..., None]]:
    """A Rich progress bar on stderr (tokens, tokens/s, elapsed, ETA); yields
    progress(done, total, unit="tokens"). A first call past 0 (a resumed ingest) does not count
    as speed. Calls in ``TOKENIZING`` units (a long document being tokenised, before its
    tokens are read) show as ``label (tokenizing)`` with their own speed and ETA. When stderr
    is not a terminal, periodic plain log lines instead (:class:`ProgressLog`), the first at
    once while tokenizing or for ``ANNOUNCED_TOKENS`` tokens or more."""
    if not err.is_terminal:
        logs: dict[str, ProgressLog] = {}

        def update_log(done: int, total: int, unit: str = "tokens") -> None:
            if unit not in logs:
                logs[unit] = ProgressLog(
                    f"{label} (tokenizing)" if unit == TOKENIZING else label,
                    lambda line: err.print(Text(line), soft_wrap=True),
                    unit=unit,
                    announce=unit == TOKENIZING or total >= ANNOUNCED_TOKENS,
                )
            logs[unit].update(done, total)

        yield update_log
        return
    with Progress(
        TextColumn("{task.description}", markup=False),  # file names are text
        BarColumn(),
        TokenCount(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        EtaColumn(),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=None, eta=None)
        shown = None  # the unit the bar counts now
        eta = Eta()

        def update(done: int, total: int, unit: str = "tokens") -> None:
            nonlocal shown, eta
            if unit != shown:  # a new count: start the speed estimate here
                eta = Eta()
            left = eta.update(done, total)  # a resumed ingest: timed from its first update
            facts = {"eta": left, "eta_at_least": eta.at_least, "unit": unit}
            if unit != shown:  # whatever was done before does not count as speed
                name = f"{label} (tokenizing)" if unit == TOKENIZING else label
                bar.reset(task, total=total, completed=done, description=name, **facts)
                shown = unit
            else:
                bar.update(task, completed=done, total=total, **facts)

        yield update


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


def open_store(file, model: str | None, threads: int, max_tokens: int = MAX_TOKENS):
    """Load document and model, then find or build the document's span store (progress on stderr).

    Returns (loaded, document, context, store, cache_hit, seconds).
    """
    import time

    from sekv_core.documents import load_document

    start = time.perf_counter()
    with reading_notice([Path(file)]):
        document = load_document(file, max_tokens)
    check_home(answering=True)
    from sekv_core.engine import check_window  # torch: only once the input is known to be usable
    from sekv_core.prompt import chat_template, encode_context
    from sekv_core.ingest import open_or_build

    loaded = load_model_quietly(model, threads)
    with prefill_progress(f"Ingesting {one_line(document.path.name)}") as progress:
        context = encode_context(
            loaded.tokenizer,
            chat_template(loaded.tokenizer),
            document.text,
            lambda done, total: progress(done, total, TOKENIZING),
        )
        check_document_tokens(loaded, document, context, max_tokens, StoreSettings())
        check_window(loaded, document, context, books=True)  # books are streamed
        store, hit = open_or_build(
            loaded,
            document,
            context,
            progress=progress,
            warn=warn,
        )
    return loaded, document, context, store, hit, time.perf_counter() - start


READING_NOTICE_S = 1.0  # reading files that takes longer than this is said on stderr


@contextmanager
def reading_notice(paths: Sequence[Path]) -> Iterator[None]:
    """While the block reads ``paths``: if it is still at it after ``READING_NOTICE_S``, one
    stderr line says so, naming the files (and sizes) given (nothing for a quick read, or one
    refused at once)."""
    import threading

    def say() -> None:
        named = []
        for path in paths:
            try:
                size = f" ({path.stat().st_size / 2**20:,.1f} MiB)" if path.is_file() else ""
            except OSError:
                size = ""
            named.append(f"{one_line(path.name)}{size}")
        err.print(Text(f"Reading {', '.join(named)}…"), soft_wrap=True)

    timer = threading.Timer(READING_NOTICE_S, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def check_home(answering: bool = False) -> None:
    """Fail before the model loads if ``$SEKV_HOME`` (stores, routers, the default model's
    converted copy) cannot be written, rather than after a prefill. ``answering``: a read-only
    home that holds stores (a shared cache) is used as it is (:mod:`sekv_core.paths`: work
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


def check_document_tokens(loaded, document, context, max_tokens: int, store_settings) -> None:
    """Refuse a document over ``max_tokens`` tokens before it is prefilled, unless its span
    store for ``store_settings`` is built already (nothing left to read)."""
    from sekv_core.documents import check_tokens
    from sekv_core.ingest import store_path

    tokens = len(context) - context.doc_start
    if tokens > max_tokens and not store_path(loaded, document, context, store_settings).exists():
        check_tokens(document, tokens, max_tokens)


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
