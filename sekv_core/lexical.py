"""Lexical ranking: BM25 (``rank_bm25``) of texts against a question's words.

The retrieval baseline ranks its passages with it (:mod:`sekv_core.methods.window`); a book's
SeKV answer ranks sentences with it beside the question's attention
(:func:`sekv_core.passages.fuse`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np
from rank_bm25 import BM25Okapi

WORD = re.compile(r"\w+")
STOPWORDS = frozenset(
    "a an and are as at be been being but by can could did do does for from had has have he her "
    "him his how i if in into is it its me my no nor not of on or our she so than that the their "
    "them then there these they this those to us was we were what when where which who whom why "
    "will with would you your".split()
)  # function words: what a question says, not what it is about


def words(text: str) -> list[str]:
    """BM25 terms: lower-cased words."""
    return WORD.findall(text.lower())


class LexicalIndex:
    """BM25 over ``texts``, built once; :meth:`scores` ranks them against one question."""

    def __init__(self, texts: Sequence[str]) -> None:
        self.index = BM25Okapi([words(t) for t in texts]) if texts else None

    def scores(self, question: str) -> np.ndarray:
        """(len(texts),) float64 BM25 score of each text for the question's words."""
        if self.index is None:
            return np.zeros(0)
        return np.asarray(self.index.get_scores(words(question)), dtype=np.float64)

    def coverage(self, question: str) -> float:
        """How much of the question the best text says in its words, in [0, 1]: its BM25 score
        for the question's words (function words left out) over what a text of average length
        holding each once would score, the sum of their idf (a word no text holds counts as the
        rarest). Near 1: the question is asked in a text's own words; low: in other words, or
        about something no text holds."""
        terms = [t for t in words(question) if t not in STOPWORDS]
        if self.index is None or not terms:
            return 0.0
        rarest = math.log((self.index.corpus_size + 0.5) / 0.5)
        most = sum(self.index.idf.get(t, rarest) for t in terms)
        return min(1.0, float(self.index.get_scores(terms).max()) / most) if most > 0 else 0.0
