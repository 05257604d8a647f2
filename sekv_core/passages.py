"""Passages: what a book's answer reads — whole sentences around the spans its question chose.

Beyond the model window a span store holds thousands of spans, and routing each layer, head and
answer token on its own scatters the zoom over fragments of many unrelated sentences: the
planted fact is zoomed, but holds a sliver of the answer's attention. A book's answer therefore
routes in two stages (:class:`sekv_core.methods.sekv.SeKV`):

1. the question is read once with the usual per-layer routing; the exact attention its tokens
   pay each zoomed span, summed over layers and heads, less what a question about nothing in
   particular (:data:`NEUTRAL_QUESTION`, read the same way once per session) pays it, ranks the
   spans (:func:`specific`); so do the BM25 score of each span's sentence for the question's
   words (:mod:`sekv_core.lexical`) and the cosine of its sentence's embedding and the
   question's (:class:`sekv_core.methods.book_reading.SentenceMeaning`), and the rankings are
   fused (:func:`fuse`);
2. the best spans grow into passages — their sentences with ``context`` sentences on each side —
   added best first while they fit ``budget`` tokens; every layer and KV head then reads the
   same passages for the whole answer, each in document order, the best passage last, right
   before the question (:func:`placement`): a small model answers from what it read last.
"""

from __future__ import annotations

import re

import numpy as np
import torch

SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)\n*|\n+")  # ".\n" and "\n\n" end one sentence
CONTEXT_SENTENCES = 1  # sentences each side of a chosen span's own
# the baseline question: the attention it pays a span is what any question would
NEUTRAL_QUESTION = "What does this document say?"
# reciprocal-rank fusion: a span earns 1 / (FUSION_K + r) from each ranking, r = 1 for its best;
# the customary constant, which keeps either ranking's top few from deciding alone
FUSION_K = 60
# meaning joins the ranking when the best sentence says less of the question than this in its
# words (:meth:`sekv_core.lexical.LexicalIndex.coverage`): books' questions in their own words
# cover 0.72-0.91 of it, paraphrased ones 0.06-0.24 (docs/design.md)
WORDS_FOUND = 0.4


def specific(scores: torch.Tensor, baseline: torch.Tensor) -> torch.Tensor:
    """(N,) the attention a question pays each span beyond what the neutral question pays it
    (both (N,), 0 where not zoomed); never below 0. A question that draws no span more than
    the neutral one does (it is as general) keeps its own scores.

    Some spans draw attention whatever is asked: the first ones packed after the sinks, the
    last ones before the question, stock phrases the book repeats. In a book of thousands of
    spans they hold the top of the question's own ranking and the passages would be theirs.
    """
    scores = scores.float()
    beyond = (scores - baseline.to(scores.device).float()).clamp(min=0)
    return beyond if bool((beyond > 0).any()) else scores


def fuse(*rankings: torch.Tensor) -> torch.Tensor:
    """(N,) one score per span from several (N,) scores (above 0: ranked; 0: not): the sum over
    them of 1 / (FUSION_K + 1 + rank), rank counting the spans that score strictly higher (ties
    share a rank: the spans of one sentence, its BM25 score). Above 0 where any is; on the
    first ranking's device.

    The question's attention finds what its words do not say (a paraphrase), its words find what
    the attention spreads thin over thousands of spans (a name, a code); neither's scale means
    anything to the other, their ranks do.
    """
    total = torch.zeros(rankings[0].shape[0], dtype=torch.float)
    for scores in rankings:
        scores = scores.detach().float().cpu()
        ascending = scores.sort().values
        rank = scores.shape[0] - torch.searchsorted(ascending, scores, right=True)
        total += torch.where(scores > 0, 1.0 / (FUSION_K + 1 + rank.float()), 0.0)
    return total.to(rankings[0].device)


def sentence_texts(text: str) -> list[str]:
    """The text of each sentence (:func:`sentence_index`'s numbering; the last runs to the end,
    empty when the text ends with a sentence end)."""
    ends = sentence_ends(text)
    starts = [0, *ends]
    return [text[a:b] for a, b in zip(starts, [*ends, len(text)], strict=True)]


def span_sentences(text: str, char_starts: np.ndarray) -> torch.Tensor:
    """(N,) sentence index of each span (spans in document order), from its first character."""
    return torch.from_numpy(sentence_index(text, char_starts))


def sentence_index(text: str, char_starts: np.ndarray) -> np.ndarray:
    """Sentence index (int64) of each character offset in ``char_starts``.

    A sentence ends at ``.``, ``!`` or ``?`` before white space, or at a line break.
    """
    ends = np.array(sentence_ends(text), dtype=np.int64)
    return np.searchsorted(ends, char_starts, side="right").astype(np.int64)


def sentence_ends(text: str) -> list[int]:
    """The character offset just past each sentence's end (:data:`SENTENCE_END`)."""
    return [m.end() for m in SENTENCE_END.finditer(text)]


def choose(
    scores: torch.Tensor,
    sentences: torch.Tensor,
    lengths: torch.Tensor,
    budget: int,
    context: int = CONTEXT_SENTENCES,
) -> torch.Tensor:
    """(N,) bool: the spans of the passages to read.

    scores (N,): how much the question drew on each span (0: not at all; never chosen);
    sentences (N,): non-decreasing sentence index of each span; lengths (N,): span tokens.
    Passages are added best span first until the next one would pass ``budget`` tokens (a span
    already inside a chosen passage adds nothing); a first passage larger than the budget alone
    is cut to the spans nearest its best span.
    """
    scores, sentences, lengths = scores.cpu(), sentences.cpu(), lengths.cpu().long()
    chosen = torch.zeros(scores.shape[0], dtype=torch.bool)
    used = 0
    for i in scores.argsort(descending=True, stable=True).tolist():
        if scores[i] <= 0:
            break
        if chosen[i]:
            continue
        s = int(sentences[i])
        lo = int(torch.searchsorted(sentences, s - context))
        hi = int(torch.searchsorted(sentences, s + context, right=True))
        extra = int(lengths[lo:hi][~chosen[lo:hi]].sum())
        if used + extra > budget:
            if used == 0:  # nothing fits whole: the spans nearest the best one
                chosen = _around(i, lo, hi, lengths, budget)
            break
        chosen[lo:hi] = True
        used += extra
    return chosen


def placement(chosen: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """(N,) int64: where each chosen span's passage goes among the passages read, 0 first (the
    farthest from the question), the passage of the best score last. A passage is a run of
    consecutive chosen spans (passages that touch read as one) and ranks by its best span's
    score (equal ones: the earlier first); spans not chosen: 0."""
    chosen, scores = chosen.cpu().bool(), scores.detach().float().cpu()
    out = torch.zeros(chosen.shape[0], dtype=torch.long)
    if not bool(chosen.any()):
        return out
    starts = chosen & ~torch.cat([chosen.new_zeros(1), chosen[:-1]])
    run = torch.cumsum(starts.long(), 0)[chosen] - 1  # each chosen span's passage
    passages = int(starts.sum())
    best = torch.full((passages,), -torch.inf).scatter_reduce(0, run, scores[chosen], reduce="amax")
    rank = torch.empty(passages, dtype=torch.long)
    rank[best.argsort(stable=True)] = torch.arange(passages)
    out[chosen] = rank[run]
    return out


def _around(i: int, lo: int, hi: int, lengths: torch.Tensor, budget: int) -> torch.Tensor:
    """Spans of [lo, hi) nearest span ``i`` (itself first) within ``budget`` tokens."""
    chosen = torch.zeros(lengths.shape[0], dtype=torch.bool)
    order = sorted(range(lo, hi), key=lambda j: (abs(j - i), j))
    used = 0
    for j in order:
        if used + int(lengths[j]) > budget and used:
            break
        chosen[j] = True
        used += int(lengths[j])
    return chosen
