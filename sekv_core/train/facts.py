"""What every generated training document is made of: the planted facts and the people in them.

A fact is one sentence planted in filler, the question it answers and the answer string (a
substring of the sentence). Both generators (:mod:`~sekv_core.train.prose`,
:mod:`~sekv_core.train.reports`) draw people's names from the lists here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fact:
    """A planted sentence, the question on it and its answer (a substring of the sentence)."""

    sentence: str
    question: str
    answer: str


@dataclass(frozen=True)
class TrainDoc:
    """A generated document: its text, the facts planted in it and its topic."""

    text: str
    facts: list[Fact]
    topic: str


FIRST = [
    "Amara",
    "Tobias",
    "Ines",
    "Kwame",
    "Lotte",
    "Ravi",
    "Sunniva",
    "Mateo",
    "Yara",
    "Oskar",
    "Noor",
    "Emeric",
    "Hana",
    "Dario",
    "Freya",
    "Idris",
]
LAST = [
    "Vasquez",
    "Lindqvist",
    "Okafor",
    "Brennan",
    "Takeda",
    "Moreau",
    "Halloran",
    "Petrova",
    "Achebe",
    "Sorensen",
    "Castell",
    "Nakamura",
    "Whitlock",
    "Ferreira",
    "Kowal",
    "Duarte",
]
