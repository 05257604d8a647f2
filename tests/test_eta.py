"""The ingest ETA: honest when later chunks cost more (a book's store grows as it streams)."""

from __future__ import annotations

import pytest

from sekv_cli.eta import Eta

CHUNK = 512


def run(total: int, cost, start: int = 0):
    """Stream ``total`` tokens in chunks whose cost per token is ``cost(position)``; yields
    (done, Eta's estimate, true time left, a 30-second constant-speed estimate)."""
    clock = [0.0]
    eta = Eta(clock=lambda: clock[0])
    times, done = [(start, 0.0)], start
    eta.update(done, total)
    while done < total:
        n = min(CHUNK, total - done)
        clock[0] += cost(done + n / 2) * n
        done += n
        times.append((done, clock[0]))
        yield done, eta.update(done, total), list(times)


def test_estimate_follows_a_cost_that_grows_with_the_store():
    total = 153_000
    cost = lambda x: 0.0055 + 0.0085 * x / total  # noqa: E731  s/token: 5.5 ms -> 14 ms
    rows = list(run(total, cost))
    end = rows[-1][2][-1][1]
    for share in (0.1, 0.25, 0.5, 0.75):
        done, said, times = next(r for r in rows if r[0] >= share * total)
        now = times[-1][1]
        actual = end - now
        assert said == pytest.approx(actual, rel=0.05), share
        # what a constant recent speed would have said: far too little early on
        recent = [t for t in times if t[1] >= now - 30]
        speed = (done - recent[0][0]) / (now - recent[0][1])
        constant = (total - done) / speed
        if share <= 0.25:
            assert constant < 0.75 * actual


def test_constant_cost_is_estimated_exactly_and_a_resumed_ingest_counts_from_its_start():
    total = 20_000
    rows = list(run(total, lambda x: 0.004, start=8_000))
    done, said, times = rows[3]
    assert said == pytest.approx((total - done) * 0.004, rel=1e-6)
    assert all(r[1] is None for r in rows[:2])  # too few intervals to say anything yet
    assert rows[-1][1] == pytest.approx(0.0, abs=1e-9)


def test_a_growth_fitted_on_the_first_chunks_of_a_book_is_not_carried_to_its_end():
    """Early in a long ingest the time left is today's cost per token for all that is left,
    a lower bound shown as such, not the growth of a few chunks carried over millions of
    tokens (years)."""
    from sekv_cli.eta import TRUSTED_SHARE, clock_time, eta_text

    total = 14_000_000
    cost = lambda x: 0.005 * (1 + x / 2000)  # noqa: E731  noisy early chunks: steep growth
    rows = []
    for done, said, _times in run(total, cost):
        rows.append((done, said))
        if done > 6 * CHUNK:
            break
    done, said = rows[-1]
    assert said is not None and said < 100 * 24 * 3600  # not years
    assert said == pytest.approx(cost(done) * (total - done), rel=0.2)  # today's cost
    assert done < TRUSTED_SHARE * total
    assert eta_text(said, True).startswith("≥ ") and "d " in clock_time(said)
    assert clock_time(90061) == "1d 01:01:01" and clock_time(3599) == "0:59:59"


def test_a_log_line_after_other_work_times_only_the_new_work():
    """Indexing bytes then building stores, or a later question's builds: each from its own
    start, at its own speed."""
    from sekv_cli.eta import ProgressLog

    clock, lines = [0.0], []
    log = ProgressLog("Reading", lines.append, clock=lambda: clock[0])
    for done in range(0, 1_000_001, 100_000):  # slow earlier work: 100 s
        log.update(done, 1_000_000)
        clock[0] += 10.0
    lines.clear()
    for done in range(0, 10_001, 1_000):  # then 10,000 units at one a second
        log.update(done, 10_000)
        clock[0] += 1_000.0
    half = next(line for line in lines if "5,000/10,000" in line)
    assert "1:23:20 elapsed" in half  # 5,000 s since the new work began (old: from 0:00:00)
    assert half.endswith("ETA 1:23:20")  # its own speed (old: fitted on the earlier work too)
