"""String-match scoring as RULER does it: expected strings contained in the answer.

Matching ignores case and collapses whitespace. Mode ``"all"`` scores the fraction of expected
strings found (RULER's ``string_match_all``; correct only when all are found); ``"any"`` scores
1 when at least one is found (``string_match_part``).
"""

from __future__ import annotations

from collections.abc import Sequence

MODES = ("all", "any")


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def score(answer: str, expected: Sequence[str], mode: str) -> float:
    """Share of ``expected`` found in ``answer`` (``"all"``), or 0/1 for any found (``"any"``)."""
    if mode not in MODES:
        raise ValueError(f"unknown scoring mode {mode!r}; choose from {', '.join(MODES)}")
    if not expected:
        raise ValueError("nothing to score against: no expected answers")
    found = [normalize(e) in normalize(answer) for e in expected]
    if mode == "any":
        return float(any(found))
    return sum(found) / len(found)


def is_correct(answer: str, expected: Sequence[str], mode: str) -> bool:
    """Whether ``answer`` fully satisfies ``mode`` (every string for "all", one for "any")."""
    return score(answer, expected, mode) == 1.0
