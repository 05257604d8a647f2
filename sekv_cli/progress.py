"""Progress on stderr: a prefill's bar (tokens, tokens/s, elapsed, ETA) or its plain log lines
where stderr is not a terminal, and a notice while files take long to read."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from .eta import Eta, ProgressLog, counted, eta_text
from .terminal import err, one_line


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
    with progress_bar() as bar:
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


def progress_bar() -> Progress:
    """The bar work is shown with on stderr: what is read, its bar, units done, elapsed time,
    ETA; gone when it ends."""
    return Progress(
        TextColumn("{task.description}", markup=False),  # file names are text
        BarColumn(),
        TokenCount(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        EtaColumn(),
        console=err,
        transient=True,
    )
