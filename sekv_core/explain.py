"""Plain words for what SeKV did for a source (the facts of ``Method.explain``), shared by the
terminal and the HTML answer view. No torch here: the CLI imports it at start-up."""

from __future__ import annotations

from typing import Any

RANKED_BY = {
    "router": "by the router for this question",
    "question": "by the question's attention (the passages a book's answer reads)",
}


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, …, 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def zoom_words(facts: dict[str, Any]) -> str:
    """e.g. "zoomed in 21 of 30 layers (40 of 90 layer-heads); ranked 2nd of 526 spans by the
    router for this question (in layer 14, its best)"."""
    where = f" (in layer {facts['rank_layer']}, its best)" if "rank_layer" in facts else ""
    return (
        f"zoomed in {facts['layers_zoomed']} of {facts['layers']} layers "
        f"({facts['zoomed_heads']} of {facts['heads']} layer-heads); ranked "
        f"{ordinal(facts['rank'])} of {facts['spans']:,} spans "
        f"{RANKED_BY.get(facts.get('ranked_by', ''), '')}{where}"
    )
