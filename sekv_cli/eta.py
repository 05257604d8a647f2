"""Time left of a streamed ingest, whose cost per token grows as its store grows.

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
