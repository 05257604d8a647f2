"""A book's question read once: the first routing stage of :mod:`sekv_core.passages`.

The question is read with the usual per-layer routing over the bounded memory; the attention its
tokens pay each zoomed span, summed over layers and heads, less what the neutral question pays
them (read the same way), ranks the spans; so do the question's words, by BM25 over the book's
sentences, and its meaning, by the cosine of each span's sentence embedding and the question's
(:class:`SentenceMeaning`: the book's sentences as the collection index holds them).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from transformers import DynamicCache

from ..decode import PositionedStep
from ..documents import Document
from ..index.catalog import Catalog
from ..index.embedder import load_embedder
from ..lexical import LexicalIndex
from ..models import LoadedModel
from ..passages import NEUTRAL_QUESTION
from ..prompt import encode_question
from ..zoom.attention import ZoomPolicy
from ..zoom.memory import SpanMemory


def question_attention(
    loaded: LoadedModel, spans: SpanMemory, question_ids: list[int], policy: ZoomPolicy
) -> torch.Tensor:
    """(N,) the attention the question's tokens pay each span, read once with ``policy``'s
    per-layer routing (the question from its ``pool_end`` on) inside an active
    :func:`~sekv_core.zoom.attention.sekv_attention` block (0: never zoomed); the pools it
    zoomed are dropped after."""
    ask = PositionedStep(
        loaded.model,
        DynamicCache(config=loaded.model.config),
        policy.pool_end,
        loaded.device,
        sekv_memory=spans,
        sekv_policy=policy,
    )
    ask(torch.tensor([question_ids], dtype=torch.long))
    spans.drop_pools()  # the answer reads the passages only
    mass = policy.trace.mass
    return mass[:-1].float() if mass is not None else spans.lengths.new_zeros(spans.n_spans).float()


def neutral_attention(loaded: LoadedModel, spans: SpanMemory, policy: ZoomPolicy) -> torch.Tensor:
    """(N,) what :data:`~sekv_core.passages.NEUTRAL_QUESTION` pays each span when read as
    ``policy`` reads a question (same router, budget, margin and neighbours; its own trace)."""
    tokenizer = loaded.tokenizer
    ids = encode_question(tokenizer, loaded.template, NEUTRAL_QUESTION)
    neutral = ZoomPolicy(
        router=policy.router,
        budget=policy.budget,
        margin=policy.margin,
        neighbours=policy.neighbours,
        attribute=False,
        pool_end=policy.pool_end,
    )
    return question_attention(loaded, spans, ids, neutral)


def word_scores(
    index: LexicalIndex, sentences: torch.Tensor, question: str
) -> tuple[torch.Tensor, float]:
    """(N,) the BM25 score of each span's sentence for the question's words (``sentences`` (N,):
    each span's index into the texts of ``index``), 0 where the sentence shares none; and how
    much of the question the best sentence says in its words (:meth:`LexicalIndex.coverage`)."""
    per_sentence = torch.from_numpy(index.scores(question)).float()
    return per_sentence[sentences.long()].clamp(min=0), index.coverage(question)


class SentenceMeaning:
    """A book's sentences as the collection index holds them (embedded once per text, kept in
    ``$SEKV_HOME/index.sqlite``): :meth:`scores` gives each span the cosine of its sentence's
    embedding and a question's.

    ``span_chars`` (N,): each span's first character in ``document.text``. Raises SekvError
    where the index cannot be used; :meth:`usable` is False when the file on disk is no longer
    the document read (edited since): its sentences would not be the store's."""

    def __init__(
        self,
        document: Document,
        span_chars: np.ndarray,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        with Catalog(warn=warn) as catalog:
            indexed = catalog.sync([document.path], embedder=load_embedder).files[0]
            self.usable = indexed.content is not None and indexed.sha256 == document.sha256
            passages = catalog.passages([indexed.content] if self.usable else [])
        self.vectors = passages.vectors.astype(np.float32)  # (P, dims) unit rows
        starts = passages.chars[:, 0]  # (P,) sorted: passages in document order
        last = max(len(starts) - 1, 0)
        self.span_passage = np.clip(np.searchsorted(starts, span_chars, side="right") - 1, 0, last)

    def scores(self, question: str) -> torch.Tensor | None:
        """(N,) float32: the cosine of each span's sentence and ``question``, never below 0;
        None where the index holds no sentence of this document."""
        if not self.usable or not len(self.vectors):
            return None
        query = load_embedder().embed([question])[0]  # (dims,)
        cosine = self.vectors @ query  # (P,)
        return torch.from_numpy(cosine[self.span_passage]).float().clamp(min=0)
