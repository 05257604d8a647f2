"""Plain words (:mod:`sekv_cli.words`): byte counts, ordinals, what SeKV did for a source."""

from __future__ import annotations

from sekv_cli.words import human_bytes, ordinal, zoom_words


def test_byte_counts_in_binary_units():
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536 * 1024, 3 * 2**30, 5 * 2**40)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 MiB", "3.0 GiB", "5120.0 GiB"
    ]  # fmt: skip


def test_zoom_facts_in_plain_words():
    facts = {
        "layers_zoomed": 21,
        "layers": 30,
        "zoomed_heads": 41,
        "heads": 90,
        "question_heads": 23,
        "first_choice": 9,
        "rank": 43,
        "spans": 526,
        "ranked_by": "router",
    }
    assert zoom_words(facts) == (
        "picked for the question by 23 of 90 layer-heads (43rd of 526 spans), the first choice "
        "of 9; zoomed in 21 of 30 layers while answering"
    )
    assert ", the first choice" not in zoom_words({**facts, "first_choice": 0})
    facts.update(ranked_by="question", rank=2, spans=12000)
    assert zoom_words(facts).startswith(
        "read as a passage: 2nd of 12,000 spans by the question's words and its attention "
        "beyond a neutral question's; zoomed in 21"
    )
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 102, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "102nd", "111th"
    ]  # fmt: skip
