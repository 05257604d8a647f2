"""Which document of a collection a question goes to: documents ranked by their passages' BM25.

Every document is cut into the retrieval baseline's passages (runs of sentences of about
``PASSAGE_TOKENS`` tokens, :func:`sekv_core.methods.window.cut_passages`) and one BM25 index
holds the passages of every document, so a word weighs by its rarity across the whole
collection. A document scores its best passage's score. The index is text only: ranking a
question reads no span store, so a collection's answer loads the store of the document it
answers from, not all of them.

The index is kept as postings (each word's passages and counts) that a document adds to, and
each word's weight is computed when a question is ranked, so a document added later is ranked
as if it had been there from the start. Its idf is Lucene's, ``log(1 + (N - n + 0.5) / (n +
0.5))``, above 0 for every word: a score above 0 means the passage holds a word of the question,
however small the collection (Okapi's idf is 0 or below for a word in half of the passages).
Function words (:data:`STOPWORDS`) are not indexed: in a small collection they are rare enough
to outweigh the words a question is about.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .lexical import words
from .methods.window import cut_passages

ROUTED = 5  # documents an answer's routing lists
K1, B = 1.5, 0.75  # BM25's term-frequency saturation and length normalisation (rank_bm25's)
STOPWORDS = frozenset(
    "a an and are as at be been being but by can could did do does for from had has have he her "
    "him his how i if in into is it its me my no nor not of on or our she so than that the their "
    "them then there these they this those to us was we were what when where which who whom why "
    "will with would you your".split()
)


def terms(text: str) -> list[str]:
    """The words BM25 counts: lower-cased, function words left out."""
    return [w for w in words(text) if w not in STOPWORDS]


class PassageIndex:
    """BM25 over passages, added in batches; :meth:`scores` ranks them against a question."""

    def __init__(self) -> None:
        self.postings: dict[str, tuple[list[int], list[int]]] = {}  # word -> passages, counts
        self.lengths: list[int] = []  # words of each passage

    def __len__(self) -> int:
        return len(self.lengths)

    def add(self, texts: Sequence[str]) -> None:
        """Index ``texts`` as the next passages."""
        for text in texts:
            counted = terms(text)
            pid = len(self.lengths)
            self.lengths.append(len(counted))
            for word, count in Counter(counted).items():
                ids, counts = self.postings.setdefault(word, ([], []))
                ids.append(pid)
                counts.append(count)

    def scores(self, question: str) -> np.ndarray:
        """(passages,) float64: each passage's BM25 score for the question's words (each word
        once)."""
        out = np.zeros(len(self.lengths))
        if not self.lengths:
            return out
        lengths = np.asarray(self.lengths, dtype=np.float64)
        norm = K1 * (1 - B + B * lengths / max(lengths.mean(), 1e-9))  # (P,)
        for word in dict.fromkeys(terms(question)):
            if word not in self.postings:
                continue
            ids, counts = (np.asarray(x) for x in self.postings[word])
            idf = np.log1p((len(self.lengths) - len(ids) + 0.5) / (len(ids) + 0.5))
            out[ids] += idf * counts * (K1 + 1) / (counts + norm[ids])
        return out


@dataclass(frozen=True)
class Ranked:
    """A document's place for a question: its number in the collection, its best passage's
    BM25 score (0: no word of the question in it) and that passage's characters."""

    index: int
    score: float
    chars: tuple[int, int]


class CollectionRouter:
    """The documents :meth:`add` gave, ranked for a question by :meth:`rank`."""

    def __init__(self) -> None:
        self.index = PassageIndex()
        self.owners: list[int] = []  # each passage's document
        self.chars: list[tuple[int, int]] = []  # each passage's characters in its document
        self.documents = 0

    def add(self, text: str, offsets: Sequence[tuple[int, int]]) -> int:
        """Add a document (its text, and the characters of each of its tokens); returns its
        number."""
        cuts = cut_passages(text, list(offsets))
        spans = [(int(offsets[a][0]), int(offsets[b - 1][1])) for a, b in cuts]
        self.index.add([text[a:b] for a, b in spans])
        self.owners += [self.documents] * len(spans)
        self.chars += spans
        self.documents += 1
        return self.documents - 1

    def rank(self, question: str) -> list[Ranked]:
        """Every document, best first (equal scores: the earlier added first)."""
        scores = self.index.scores(question)  # (P,)
        owners = np.asarray(self.owners, dtype=np.int64)
        best = np.zeros(self.documents)
        at = np.full(self.documents, -1, dtype=np.int64)
        if len(scores):
            # by document, then score (best first), then passage order: a document's best first
            order = np.lexsort((np.arange(len(scores)), -scores, owners))
            docs, first = np.unique(owners[order], return_index=True)
            best[docs], at[docs] = scores[order[first]], order[first]
        return [
            Ranked(int(i), float(best[i]), self.chars[at[i]] if at[i] >= 0 else (0, 0))
            for i in np.argsort(-best, kind="stable")
        ]
