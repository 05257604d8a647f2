"""Time left of a streamed ingest, whose cost per token grows as its store grows; progress as
log lines where no bar can be drawn.

A chunk of a book routes against every span stored so far, so later chunks take longer: a
constant-speed estimate (tokens left / recent tokens per second) promises too little. The cost
per token is fitted as ``a + b * x`` over the position ``x`` in the document (least squares,
each interval weighted by its tokens, ``b`` at least 0), and the time left is its integral from
what is done to the end. Fitted over less than ``TRUSTED_SHARE`` of the work, the growth is not
carried to the end (the first chunks of a book would foretell years): the estimate is then the
time left at today's cost per token, a lower bound (``at_least``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

MIN_INTERVALS = 3  # intervals measured before an estimate is given
TRUSTED_SHARE = 0.05  # share of the work done before the cost's growth is carried to the end


class Eta:
    """Feed ``update(done, total)`` as work progresses; ``remaining`` is seconds left or None."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.last: tuple[int, float] | None = None
        self.intervals: list[tuple[float, float, int]] = []  # (mid position, s/token, tokens)
        self.remaining: float | None = None
        self.at_least = False  # ``remaining`` is a lower bound (too little done to say more)

    def update(self, done: int, total: int) -> float | None:
        now = self.clock()
        if self.last is not None and done > self.last[0]:
            start, then = self.last
            tokens = done - start
            self.intervals.append(((start + done) / 2, (now - then) / tokens, tokens))
        if self.last is None or done > self.last[0]:
            self.last = (done, now)
        self.remaining = self._left(done, total)
        return self.remaining

    def _left(self, done: int, total: int) -> float | None:
        if len(self.intervals) < MIN_INTERVALS:
            return None
        w = sum(n for _, _, n in self.intervals)
        mx = sum(x * n for x, _, n in self.intervals) / w
        my = sum(y * n for _, y, n in self.intervals) / w
        sxx = sum(n * (x - mx) ** 2 for x, _, n in self.intervals)
        sxy = sum(n * (x - mx) * (y - my) for x, y, n in self.intervals)
        b = max(sxy / sxx, 0.0) if sxx > 0 else 0.0
        a = my - b * mx
        self.at_least = b > 0 and done < TRUSTED_SHARE * total
        if self.at_least:  # today's cost per token for all that is left
            return max((a + b * done) * (total - done), 0.0)
        left = a * (total - done) + b * (total**2 - done**2) / 2
        return max(left, 0.0)


LOG_EVERY_S = 30.0  # without a terminal: a progress line at least this often…
LOG_GAP_S = 5.0  # …and at each tenth done, but never sooner than this after the last line


class ProgressLog:
    """Progress as plain log lines, for a stderr that is not a terminal (no bar is drawn).

    ``update(done, total)`` calls ``write`` with ``label: done/total tokens (p%), elapsed, ETA``
    at each tenth of the work and every ``LOG_EVERY_S`` seconds, never within ``LOG_GAP_S`` of
    the last line: work done in a few seconds prints nothing, unless ``announce``: then the
    first update prints a line at once. ``unit`` names what is counted (``tokens``,
    ``characters``). New work (another total, or fewer done than before) starts its elapsed
    time and ETA afresh.
    """

    def __init__(
        self,
        label: str,
        write: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        unit: str = "tokens",
        announce: bool = False,
    ) -> None:
        self.label, self.write, self.clock, self.unit = label, write, clock, unit
        self.eta = Eta(clock)
        self.start = self.last = clock()
        self.tenth = 0  # tenths of the work done at the last line (or at the first update)
        self.first, self.announce = True, announce
        self.seen: tuple[int, int] | None = None  # the last (done, total)

    def update(self, done: int, total: int) -> None:
        if self.seen is not None and (total != self.seen[1] or done < self.seen[0]):
            self.eta, self.start = Eta(self.clock), self.clock()  # new work: its own clock
            self.first, self.tenth = True, 0
        self.seen = (done, total)
        left = self.eta.update(done, total)
        now = self.clock()
        tenth = 10 * done // total if total > 0 else 0
        if self.first:  # a resumed ingest: what was done before is not news
            self.first, self.tenth = False, tenth
            if self.announce:
                self.write(f"{self.label}: {counted(done, total, self.unit)}…")
            return
        since = now - self.last
        if since < LOG_GAP_S or (tenth <= self.tenth and since < LOG_EVERY_S):
            return
        self.last, self.tenth = now, tenth
        share = f" ({done / total:.0%})" if total > 0 else ""
        eta = "" if left is None else f", ETA {eta_text(left, self.eta.at_least)}"
        self.write(
            f"{self.label}: {counted(done, total, self.unit)}{share}, "
            f"{clock_time(now - self.start)} elapsed{eta}"
        )


def counted(done: float, total: float | None, unit: str = "tokens") -> str:
    """``1,234/5,678 tokens``; characters in millions (``12.3M/57.2M characters``), bytes in
    MB."""
    if unit == "bytes":
        whole = "?" if total is None else f"{total / 1e6:.1f}"
        return f"{done / 1e6:.1f}/{whole} MB"
    if unit == "characters":
        whole = "?" if total is None else f"{total / 1e6:.1f}M"
        return f"{done / 1e6:.1f}M/{whole} characters"
    return f"{done:,.0f}/{'?' if total is None else f'{total:,.0f}'} {unit}"


def eta_text(seconds: float, at_least: bool = False) -> str:
    """Time left as :func:`clock_time`, ``≥`` before a lower bound."""
    return f"≥ {clock_time(seconds)}" if at_least else clock_time(seconds)


def clock_time(seconds: float) -> str:
    """``h:mm:ss``; ``Nd hh:mm:ss`` from a day on."""
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    if h >= 24:
        d, h = divmod(h, 24)
        return f"{d}d {h:02d}:{m:02d}:{s:02d}"
    return f"{h}:{m:02d}:{s:02d}"
