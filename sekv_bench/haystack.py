"""Generated haystacks with a planted needle fact (no copied text: sentences built from parts)."""

from __future__ import annotations

import random
from dataclasses import dataclass

SUBJECTS = [
    "The harbour board",
    "A survey team",
    "The town council",
    "The weather station",
    "The ferry company",
    "A group of volunteers",
    "The library committee",
    "The mill",
    "The school garden club",
    "The coastal patrol",
    "The bakery on Quay Street",
    "The museum archive",
    "The orchard cooperative",
    "The railway depot",
]
VERBS = [
    "reviewed",
    "repaired",
    "measured",
    "catalogued",
    "discussed",
    "painted",
    "inspected",
    "rebuilt",
    "cleaned",
    "mapped",
    "recorded",
    "moved",
    "tested",
    "planned",
]
OBJECTS = [
    "the north pier",
    "the tide gauges",
    "the old granary roof",
    "the footpath signs",
    "the rainfall records",
    "the stone bridge",
    "the lantern room",
    "the boat sheds",
    "the market stalls",
    "the water pumps",
    "the reading room shelves",
    "the sea wall",
    "the allotment fences",
    "the signal cabin",
]
TIMES = [
    "in early spring",
    "after the autumn storms",
    "during the summer fair",
    "last winter",
    "over three weekends",
    "before the regatta",
    "at the end of the season",
    "in a single afternoon",
    "with help from the county",
    "despite the fog",
]
CODA = [
    "Nobody reported any problems.",
    "The work took longer than expected.",
    "A short note was filed with the clerk.",
    "Costs stayed within the budget.",
    "Residents were pleased with the result.",
    "Further checks are planned.",
    "The minutes record a brief vote.",
    "Photographs were added to the album.",
]


@dataclass(frozen=True)
class Needle:
    fact: str
    question: str
    answer: str


NEEDLES = [
    Needle(
        "The secret password for the lighthouse archive is BLUE-HERON-47.",
        "What is the secret password for the lighthouse archive?",
        "BLUE-HERON-47",
    ),
    Needle(
        "The treasurer of the rowing club is a woman named Philippa Odonkor.",
        "Who is the treasurer of the rowing club?",
        "Philippa Odonkor",
    ),
    Needle(
        "The emergency generator is stored in warehouse number 318.",
        "In which warehouse number is the emergency generator stored?",
        "318",
    ),
]


def sentence(rng: random.Random) -> str:
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TIMES)}."
    return s if rng.random() < 0.6 else f"{s} {rng.choice(CODA)}"


def filler(tokenizer, tokens: int, rng: random.Random) -> list[str]:
    """Filler sentences until they hold at least ``tokens`` tokens (at most one sentence more)."""
    sentences, count = [], 0
    while count < tokens:
        s = sentence(rng)
        sentences.append(s)
        count += len(tokenizer(" " + s, add_special_tokens=False)["input_ids"])
    return sentences


def plant(sentences: list[str], facts: list[tuple[float, str]]) -> str:
    """Insert each ``(depth, fact)`` at relative ``depth`` (0..1) of ``sentences``; join the
    result into paragraphs of five sentences. Facts at the same place keep their given order."""
    slots: dict[int, list[str]] = {}
    for depth, fact in facts:
        slots.setdefault(round(depth * len(sentences)), []).append(fact)
    merged = []
    for i in range(len(sentences) + 1):
        merged += slots.get(i, [])
        merged += sentences[i : i + 1]
    paragraphs = [" ".join(merged[i : i + 5]) for i in range(0, len(merged), 5)]
    return "\n\n".join(paragraphs)


def haystack(tokenizer, tokens: int, depth: float, needle: Needle, seed: int = 0) -> str:
    """Filler of about ``tokens`` tokens with ``needle.fact`` at relative ``depth`` (0..1)."""
    return plant(filler(tokenizer, tokens, random.Random(seed)), [(depth, needle.fact)])
