"""Plain words for numbers and for what SeKV did for a source (the facts of ``Method.explain``),
shared by the terminal and the HTML pages. No torch here: the CLI imports it at start-up."""

from __future__ import annotations

from typing import Any


def how_many(n: int, noun: str) -> str:
    """``1 store``, ``2 stores``, ``1,234 tokens``: a count with its noun, singular for one
    (the plural adds an s: every noun counted here takes one)."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, …, 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def human_bytes(n: float) -> str:
    """A byte count in B, KiB, MiB or GiB (binary units; one decimal above bytes)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def zoom_words(facts: dict[str, Any]) -> str:
    """e.g. "picked for the question by 23 of 90 layer-heads (43rd of 526 spans), the first
    choice of 4; zoomed in 21 of 30 layers while answering". A book's passage: "read as a
    passage: 2nd of 12,000 spans by the question's words and its attention beyond a neutral
    question's; …"."""
    rank = f"{ordinal(facts['rank'])} of {how_many(facts['spans'], 'span')}"
    if facts["ranked_by"] == "question":
        why = (
            f"read as a passage: {rank} by the question's words and its attention beyond a "
            "neutral question's"
        )
    else:
        first = facts["first_choice"]
        why = (
            f"picked for the question by {facts['question_heads']} of "
            f"{how_many(facts['heads'], 'layer-head')} ({rank})"
            + (f", the first choice of {first}" if first else "")
        )
    layers = how_many(facts["layers"], "layer")
    return f"{why}; zoomed in {facts['layers_zoomed']} of {layers} while answering"
