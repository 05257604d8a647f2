"""Which documents a question is about: passages ranked by words and meaning together.

Each passage of the documents asked scores ``meaning + WORDS_WEIGHT * words``: ``meaning`` the
cosine of its embedding and the question's (:mod:`.embedder`), ``words`` its FTS5 BM25 for the
question's words divided by the best passage's (so 1 for the passage that shares the question's
rarest words best, 0 for one that shares none). A document scores its best passage. Meaning
carries a question asked in other words; the words term lifts a passage that holds the
question's rare words (a name, a code) over ones that are only on its topic. Why these weights,
and what reciprocal-rank fusion did instead: ``docs/design.md`` (finding).

The :data:`CANDIDATES` best passages are then read by the answering model
(:class:`.likelihood.QuestionLikelihood`): each gains ``MODEL_WEIGHT`` times how much more likely
the question is after it than after the least likely of them (so each keeps its place above
the passages not read, and they reorder among themselves).
The embedder matches topics; the model tells a passage that answers the question from one that
only shares its place and topic.

A question in several parts ("who runs the harbour, and what did the school cost?") is ranked
part by part (:func:`question_parts`) and the parts' rankings interleaved, so that each part's
best document is among the first.

Each ranked document says why it was picked: by ``words`` (its best passage is among the
:data:`TOP` by words but not by meaning), ``meaning`` (the reverse) or ``both``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .catalog import Catalog, Indexed, Passages
from .embedder import Embedder
from .likelihood import QuestionLikelihood

WORDS_WEIGHT = 0.1  # what a passage holding every word of the question adds to its cosine
TOP = 3  # "picked by words / meaning": among this many documents of that ranking alone
CANDIDATES = 16  # the best passages by words and meaning that the model reads again
MODEL_WEIGHT = 0.5  # what one nat of the question's mean log-probability is worth in score
# a question's parts: split where a clause or sentence starts that asks something of its own
_PART = re.compile(
    r"(?:[?;]|,? and)\s+(?=(?:\w+\s+){0,2}(?:who|whom|whose|what|which|when|where|why|how)\b)", re.I
)


@dataclass(frozen=True)
class Ranked:
    """A document's place for a question: its number among the files ranked, its score, the
    best passage's cosine (``meaning``) and normalised BM25 (``words``, 0: no word shared),
    ``why`` it ranks where it does, and its best passage (id, characters, page); ``model``: the
    question's mean log-probability after that passage (None: the model did not read it);
    ``part``: the part of the question it was ranked for (None: the whole question)."""

    index: int
    score: float
    meaning: float
    words: float
    why: str
    passage: int
    chars: tuple[int, int]
    page: int
    model: float | None = None
    part: str | None = None

    def to_json(self) -> dict:
        return {
            "score": round(self.score, 4),
            "meaning": round(self.meaning, 4),
            "words": round(self.words, 4),
            "model": None if self.model is None else round(self.model, 4),
            "why": self.why,
            "part": self.part,
            "chars": list(self.chars),
            "page": self.page,
        }


class Finder:
    """The passages of ``files`` (indexed by ``catalog``), loaded once; :meth:`rank` ranks the
    files for a question. ``embedder``: the sentence embedder (its vectors are the index's);
    ``likelihood``: the answering model's judgement of the best passages (None: words and
    meaning alone)."""

    def __init__(
        self,
        catalog: Catalog,
        files: Sequence[Indexed],
        embedder: Embedder,
        likelihood: QuestionLikelihood | None = None,
    ) -> None:
        self.catalog, self.files, self.embedder = catalog, list(files), embedder
        self.likelihood = likelihood
        contents = [f.content for f in self.files if f.content is not None]
        self.passages: Passages = catalog.passages(contents)
        self.vectors = self.passages.vectors.astype(np.float32)  # (P, dims)
        self.row = {int(pid): k for k, pid in enumerate(self.passages.ids)}
        # each content's files (two files of the same bytes share its passages)
        self.holders: dict[int, list[int]] = {}
        for i, f in enumerate(self.files):
            if f.content is not None:
                self.holders.setdefault(f.content, []).append(i)

    def passage_scores(self, question: str) -> tuple[np.ndarray, np.ndarray]:
        """(P,) cosine and (P,) normalised BM25 of every passage for ``question``."""
        query = self.embedder.embed([question])[0]  # (dims,)
        meaning = self.vectors @ query if len(self.vectors) else np.zeros(0)
        words = np.zeros(len(self.passages.ids))
        for pid, score in self.catalog.word_scores(question).items():
            if (k := self.row.get(pid)) is not None:
                words[k] = score
        return meaning, words

    def rank(self, question: str) -> list[Ranked]:
        """Every file with a content, best first (equal scores: the earlier named first); a
        question in parts: the parts' rankings interleaved."""
        parts = question_parts(question)
        if len(parts) == 1:
            return self._rank(question)
        out, seen = [], set()
        for row in zip(*(self._rank(p, part=p) for p in parts), strict=True):
            for r in row:
                if r.index not in seen:
                    seen.add(r.index)
                    out.append(r)
        return out

    def _rank(self, question: str, part: str | None = None) -> list[Ranked]:
        meaning, words = self.passage_scores(question)
        fused = meaning + WORDS_WEIGHT * words  # (P,)
        model = np.full(len(fused), np.nan)
        score = fused.copy()  # the model's candidates gain what it reads in them
        if self.likelihood is not None and len(fused):
            rows = np.argsort(-fused, kind="stable")[:CANDIDATES]
            texts = self.catalog.passage_texts([int(self.passages.ids[k]) for k in rows])
            model[rows] = self.likelihood(texts, question)
            score[rows] += MODEL_WEIGHT * (model[rows] - model[rows].min())
        best = _best_per_content(self.passages.owners, score)
        by_meaning = _best_per_content(self.passages.owners, meaning)
        by_words = _best_per_content(self.passages.owners, words)
        top_m = _top(by_meaning, meaning, TOP)
        top_w = _top(by_words, words, TOP, positive=True)
        out = []
        for content, k in best.items():
            why = {(True, True): "both", (True, False): "words", (False, True): "meaning"}.get(
                (content in top_w, content in top_m), "meaning"
            )
            a, b = (int(x) for x in self.passages.chars[k])
            for i in self.holders.get(content, []):
                out.append(
                    Ranked(
                        i,
                        float(score[k]),
                        float(meaning[by_meaning[content]]),
                        float(words[by_words[content]]),
                        why,
                        int(self.passages.ids[k]),
                        (a, b),
                        int(self.passages.pages[k]),
                        None if np.isnan(model[k]) else float(model[k]),
                        part,
                    )  # fmt: skip
                )
        out.sort(key=lambda r: (-r.score, r.index))
        return out


def question_parts(question: str) -> list[str]:
    """``question``'s parts: split where a clause asking something of its own begins ("…, and
    what …", "…? Who …", "…; which …") when both sides hold four words or more."""
    text, parts, start = question.strip(), [], 0
    for cut in _PART.finditer(text):
        head, rest = text[start : cut.start()], text[cut.end() :]
        if len(head.split()) >= 4 and len(rest.split()) >= 4:
            parts.append(head.strip(" ,;"))
            start = cut.end()
    return [*parts, text[start:]] if parts else [question]


def _best_per_content(owners: np.ndarray, scores: np.ndarray) -> dict[int, int]:
    """Each content's best passage (its row), by ``scores`` (the first of equals)."""
    if not len(owners):
        return {}
    order = np.lexsort((np.arange(len(scores)), -scores, owners))
    contents, first = np.unique(owners[order], return_index=True)
    return {int(c): int(order[f]) for c, f in zip(contents, first, strict=True)}


def _top(best: dict[int, int], scores: np.ndarray, n: int, positive: bool = False) -> set[int]:
    """The ``n`` contents whose best passage scores highest (above 0 with ``positive``)."""
    ranked = sorted(best, key=lambda c: -scores[best[c]])
    return {c for c in ranked[:n] if not positive or scores[best[c]] > 0}
