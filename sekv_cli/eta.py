"""Time left of a streamed ingest, whose cost per token grows as its store grows; progress as
log lines where no bar can be drawn.

A chunk of a book routes against every span stored so far, so later chunks take longer: a
constant-speed estimate (tokens left / recent tokens per second) promises too little. The cost
per token is fitted as ``a + b * x`` over the position ``x`` in the document (least squares,
each interval weighted by its tokens, ``b`` at least 0), and the time left is its integral from
what is done to the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable

MIN_INTERVALS = 3  # intervals measured before an estimate is given


class Eta:
    """Feed ``update(done, total)`` as work progresses; ``remaining`` is seconds left or None."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.last: tuple[int, float] | None = None
        self.intervals: list[tuple[float, float, int]] = []  # (mid position, s/token, tokens)
        self.remaining: float | None = None

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
        left = a * (total - done) + b * (total**2 - done**2) / 2
        return max(left, 0.0)


LOG_EVERY_S = 30.0  # without a terminal: a progress line at least this often…
LOG_GAP_S = 5.0  # …and at each tenth done, but never sooner than this after the last line


class ProgressLog:
    """Progress as plain log lines, for a stderr that is not a terminal (no bar is drawn).

    ``update(done, total)`` calls ``write`` with ``label: done/total tokens (p%), elapsed, ETA``
    at each tenth of the work and every ``LOG_EVERY_S`` seconds, never within ``LOG_GAP_S`` of
    the last line: work done in a few seconds prints nothing.
    """

    def __init__(
        self, label: str, write: Callable[[str], None], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.label, self.write, self.clock = label, write, clock
        self.eta = Eta(clock)
        self.start = self.last = clock()
        self.tenth = 0  # tenths of the work done at the last line (or at the first update)
        self.first = True

    def update(self, done: int, total: int) -> None:
        left = self.eta.update(done, total)
        now = self.clock()
        tenth = 10 * done // total if total > 0 else 0
        if self.first:  # a resumed ingest: what was done before is not news
            self.first, self.tenth = False, tenth
            return
        since = now - self.last
        if since < LOG_GAP_S or (tenth <= self.tenth and since < LOG_EVERY_S):
            return
        self.last, self.tenth = now, tenth
        share = f" ({done / total:.0%})" if total > 0 else ""
        eta = "" if left is None else f", ETA {clock_time(left)}"
        self.write(
            f"{self.label}: {done:,}/{total:,} tokens{share}, {clock_time(now - self.start)}"
            f" elapsed{eta}"
        )


def clock_time(seconds: float) -> str:
    """``h:mm:ss``."""
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"
