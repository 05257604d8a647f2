"""Lexical ranking: BM25 (``rank_bm25``) of texts against a question's words.

The retrieval baseline ranks its passages with it (:mod:`sekv_core.methods.window`); a book's
SeKV answer ranks sentences with it beside the question's attention
(:func:`sekv_core.passages.fuse`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
from rank_bm25 import BM25Okapi

WORD = re.compile(r"\w+")


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
