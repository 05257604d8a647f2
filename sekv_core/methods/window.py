"""What a user does without SeKV when a document exceeds the window: read part of it with full KV.

Two baselines, both answered with the model's ordinary full KV cache over a context that fits
the window (the question and the answer's room kept free):

- ``truncate``: the document's first window's worth of tokens, prefilled once;
- ``retrieve``: the document cut into passages (runs of sentences of about ``PASSAGE_TOKENS``
  tokens), ranked against each question by BM25 (``rank_bm25``), the best ones joined in
  document order until the window is full; prefilled per question (the passages depend on it).
  With ``settings.sources`` its answer's attention over the window is recorded, as full KV's is
  over the document, and placed on the document tokens each window token was read from: its
  sources are the sentences of the retrieved passages that the answer drew on.

Both read books; their resident memory is the KV cache of the context they read, counted in
fp16 like every method's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from ..decode import Forcing
from ..lexical import LexicalIndex
from ..prompt import Context, encode_context, question_text
from ..sampling import Sampling
from .base import Method, Progress
from .full import answer_attributed, answer_over, attention_buffer, prefill_cache, truncate

ANSWER_ROOM = 256  # window tokens kept for the question and the answer
PASSAGE_TOKENS = 96  # a passage ends at the first sentence end past this many tokens ...
PASSAGE_MAX = 192  # ... or here at the latest
PASSAGE_GAP = "\n\n"  # between the passages read


class WindowMethod(Method):
    """Full KV over a context that fits the window; subclasses choose the text it holds."""

    reads_books = True  # it reads any document: only part of it reaches the model
    follows_memory_share = False  # its memory is the window it fills

    cache: DynamicCache | None = None
    held_tokens: int = 0  # context tokens the last answer's cache held
    window: Context | None = None  # the context read: its offsets are into the text read

    @property
    def room(self) -> int:
        """Document tokens that fit beside the prompt head, the question and the answer."""
        return max(0, self.loaded.spec.window - self.context.doc_start - ANSWER_ROOM)

    def question_position(self) -> int:
        """Where the question starts: after the longest context this method builds."""
        return min(len(self.context), self.context.doc_start + self.room)

    def read(self, text: str, progress: Progress | None = None) -> int:
        """Prefill ``text`` (a part of the document) as the context; returns its length."""
        context = encode_context(self.loaded.tokenizer, self.loaded.template, text)
        ids = context.ids[: self.question_position()]
        chunk = self.settings.prefill_chunk
        self.cache = prefill_cache(self.loaded.model, ids, chunk, progress)
        self.held_tokens, self.window = len(ids), context
        return len(ids)

    def memory(self) -> dict[str, int]:
        return {
            "resident_bytes": self.loaded.spec.kv_bytes(self.held_tokens, 2),
            "offloaded_bytes": 0,
        }


class Truncate(WindowMethod):
    """The document's first window's worth of tokens."""

    name = "truncate"

    def prepare(self, progress: Progress | None = None) -> None:
        end = self.question_position() - self.context.doc_start  # document tokens kept
        offsets = self.context.offsets
        cut = offsets[end - 1][1] if 0 < end <= len(offsets) else 0
        self.read(self.document.text[:cut], progress)

    def generate(
        self,
        question_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling | None = None,
        forcing: Forcing | None = None,
    ) -> Iterator[int]:
        assert self.cache is not None, "prepare() first"
        truncate(self.cache, self.held_tokens)  # every question starts from the kept text
        yield from answer_over(
            self.loaded, self.cache, question_ids, max_new_tokens, sampling, forcing
        )

    def routing(self) -> dict[str, Any]:
        return {"kept_tokens": self.held_tokens - self.context.doc_start}


class Retrieve(WindowMethod):
    """BM25 passages for each question, in document order, filling the window."""

    name = "retrieve"

    passages: list[tuple[int, int]]  # (first, end) document token index of each passage
    chosen: list[int]
    attention: torch.Tensor | None = None  # (L, H_kv, T_window) the last answer's (sources)

    def prepare(self, progress: Progress | None = None) -> None:
        text, offsets = self.document.text, self.context.offsets
        self.passages = cut_passages(text, offsets)
        self.starts = [int(offsets[a][0]) for a, _ in self.passages]  # first document character
        self.texts = [text[offsets[a][0] : offsets[b - 1][1]] for a, b in self.passages]
        self.index = LexicalIndex(self.texts)
        self.chosen = []
        if progress:
            progress(len(self.context), len(self.context))

    def select(self, question: str) -> list[int]:
        """Passages by BM25 score while they fit the window, returned in document order."""
        scores = self.index.scores(question)
        left, chosen = self.room, []
        for i in sorted(range(len(scores)), key=lambda i: (-scores[i], i)):
            size = self.passages[i][1] - self.passages[i][0]
            if size <= left:
                chosen.append(i)
                left -= size
        return sorted(chosen)

    def generate(
        self,
        question_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling | None = None,
        forcing: Forcing | None = None,
    ) -> Iterator[int]:
        question = question_text(self.loaded.tokenizer, self.loaded.template, question_ids)
        self.chosen = self.select(question)
        self.read(PASSAGE_GAP.join(self.texts[i] for i in self.chosen))
        args = (self.loaded, self.cache, question_ids, max_new_tokens, sampling, forcing)
        if not self.settings.sources:
            self.attention = None
            yield from answer_over(*args)
            return
        self.attention = attention_buffer(self.loaded, self.held_tokens)
        yield from answer_attributed(*args, self.attention)

    def answer_attention(self) -> torch.Tensor | None:
        """(1, 1, T): the last answer's attention over the window (its most in any layer and
        KV head), each window token's placed on the document token it was read from."""
        if self.attention is None or not self.chosen:
            return None
        window = self.window
        weights = self.attention[..., window.doc_start :].amax(dim=(0, 1))  # (Tw,)
        read = np.asarray(window.offsets, dtype=np.int64).reshape(-1, 2)[: len(weights), 0]
        sizes = [len(self.texts[i]) for i in self.chosen]
        at = np.cumsum([0] + [n + len(PASSAGE_GAP) for n in sizes[:-1]])  # each in the window
        piece = np.searchsorted(at, read, side="right") - 1  # (Tw,) the passage each is from
        inside = read < at[piece] + np.asarray(sizes)[piece]  # not a gap between passages
        first = np.asarray([self.starts[i] for i in self.chosen])[piece]
        doc_chars = first + read - at[piece]
        doc_starts = np.asarray(self.context.offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
        token = np.searchsorted(doc_starts, doc_chars, side="right") - 1  # (Tw,) document token
        keep = torch.from_numpy(np.flatnonzero(inside & (token >= 0))).to(weights.device)
        where = torch.from_numpy(token + self.context.doc_start).to(weights.device)[keep]
        out = weights.new_zeros(len(self.context))
        out.scatter_reduce_(0, where, weights[keep], "amax")
        return out.view(1, 1, -1)

    def routing(self) -> dict[str, Any]:
        return {"passages": len(self.passages), "retrieved": len(self.chosen)}


def cut_passages(text: str, offsets: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Document token ranges of about PASSAGE_TOKENS tokens, each ending at a sentence end or
    paragraph break where one comes in time (at PASSAGE_MAX tokens otherwise)."""
    passages, start = [], 0
    for i, (_, end) in enumerate(offsets):
        size = i + 1 - start
        after = text[end : end + 1]
        at_end = text[end - 1 : end] in ".!?" and (after == "" or after.isspace())
        if size >= PASSAGE_MAX or (size >= PASSAGE_TOKENS and (at_end or "\n" in after)):
            passages.append((start, i + 1))
            start = i + 1
    if start < len(offsets):
        passages.append((start, len(offsets)))
    return passages
