"""SeKV: answer from the span store with zoom-in (mixed-resolution attention).

The context's memory is the span store (built once, then loaded from disk); the question and the
answer form the local window, kept at full resolution in an ordinary cache. The document's full
KV cache is never materialised while answering.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from transformers import DynamicCache

from .. import passages
from ..config import DEFAULT_BUDGET, reading_window
from ..decode import Forcing, PositionedStep, decode_tokens
from ..documents import Document
from ..ingest import open_or_build
from ..lexical import LexicalIndex
from ..prompt import question_text, stop_ids
from ..rope import Rope
from ..router_files import RouterFile, resolve_router
from ..sampling import Sampling
from ..store.load import SpanStore
from ..zoom.attention import Observer, ZoomPolicy, sekv_attention
from ..zoom.memory import SpanMemory
from ..zoom.router import SketchRouter, TrainedRouter
from .base import Method, Progress
from .book_reading import SentenceMeaning, neutral_attention, question_attention, word_scores

MIN_ZOOM = 32
STARVED_SHARE = 0.05  # a zoom under this share of the span tokens routes with half the sketch
PREVIEW_CHARS = 80


class SeKV(Method):
    """SeKV as ``sekv ask`` runs it: within the model's window it routes with the trained router
    ``settings.router`` names (``auto``: yours from ``sekv train``, else the one shipped for the
    model), training-free where there is none; a book routes training-free."""

    name = "sekv"
    reads_books = True  # contexts beyond the window are streamed into a bounded store

    store: SpanStore
    spans: SpanMemory
    policy: ZoomPolicy | None = None
    cache_hit: bool = False
    observer: Observer | None = None  # told of every routing decision (diagnostics)
    neutral: tuple[int, torch.Tensor] | None = None  # books: (budget, neutral_attention)
    sentence_words: LexicalIndex | None = None  # books: BM25 over the book's sentences
    sentences: torch.Tensor | None = None  # books: (N,) sentence index of each span
    meaning: SentenceMeaning | None = None  # books: the book's sentences, embedded
    trained: RouterFile | None = None  # the trained router in use; None: training-free

    def prepare(self, progress: Progress | None = None) -> None:
        self.store, self.cache_hit = open_or_build(
            self.loaded,
            self.document,
            self.context,
            self.settings.store,
            progress,
            warn=self.settings.warn,
        )
        loaded = self.loaded
        self.spans = SpanMemory(self.store, Rope(loaded.model), loaded.device, loaded.dtype)
        self.trained = self.find_trained_router()
        self.check_router_spans()
        if self.spans.bounded:  # a book: its sentences embedded (once per text) with its store
            offsets = self.store.trace["offsets"]
            first_chars = offsets[self.spans.starts.long(), 0].numpy()
            self.meaning = SentenceMeaning(self.document, first_chars, self.settings.warn)

    def uses_trained_router(self) -> bool:
        """Whether a trained router found routes this answer: not for a book (a streamed,
        bounded memory), as routers are trained on documents within the model's window."""
        return not self.spans.bounded

    def find_trained_router(self) -> RouterFile | None:
        """The trained router ``settings.router`` names where :meth:`uses_trained_router`
        (``auto``: the user's or the shipped one for this model, if any; a damaged file under
        ``auto`` is skipped with a warning), else None: training-free routing."""
        if not self.uses_trained_router():
            return None
        loaded, s = self.loaded, self.settings
        return resolve_router(s.router, loaded.fingerprint, loaded.model_id, s.warn)

    def check_router_spans(self) -> None:
        """Warn when the trained router in use learned on other span lengths than the store's
        (it still routes, less well: span length changes what a span's scores mean)."""
        trained = self.trained
        learned = trained.manifest.get("routing", {}).get("span_tokens") if trained else None
        segment = self.store.manifest["settings"]["segment"]
        here = [segment["min_len"], segment["max_len"]]
        if learned and learned != here and self.settings.warn:
            self.settings.warn(
                f"the trained router learned on {learned[0]}-{learned[1]}-token spans; this "
                f"store's spans are {here[0]}-{here[1]} tokens: routing may be worse (train a "
                "router on these spans with `sekv train`)"
            )

    def new_policy(self) -> ZoomPolicy:
        """A new answer's routing: :meth:`zoom_budget` tokens per (layer, KV head); a book's
        zoomed tokens (at most :meth:`max_band`) packed right before the question."""
        s, trained = self.settings, self.trained
        if trained is None:
            router, margin = SketchRouter(), s.margin
        else:  # a learned gate: absolute threshold
            router, margin = TrainedRouter(trained.net), None
        budget, pool_end = self.zoom_budget(), None
        if self.spans.bounded:
            budget = min(budget, self.max_band())
            pool_end = self.spans.n_sinks + budget
        return ZoomPolicy(
            router=router,
            budget=budget,
            margin=margin,
            neighbours=s.neighbours,
            observer=self.observer,
            attribute=s.sources,
            pool_end=pool_end,
        )

    def zoom_budget(self) -> int:
        """Tokens per (layer, KV head) to reconstruct: ``budget`` (default ``DEFAULT_BUDGET``),
        or less where ``memory_share`` leaves less.

        A memory target caps the zoom; it is not a level to fill: zooming far more tokens than
        the default budget makes answers drift to zoomed filler sentences. Under a target, the
        resident tier is paid first; the zoom gets the rest up to the budget, counted as
        :meth:`SpanMemory.zoom_bytes` counts it. When the whole sketch would leave the zoom
        less than ``STARVED_SHARE`` of the span tokens, the answer routes with the sketch's
        strongest half and spends all the rest on zooming (past the default budget, unless a
        budget was asked for): half the sketch routes less sharply, but a starved zoom gains
        more from the tokens. A target below the resident tier still zooms one span of
        ``MIN_ZOOM`` tokens (reported as measured).
        """
        s, spans = self.settings, self.spans
        spans.place_sketch()
        cap = s.budget or DEFAULT_BUDGET
        if s.memory_share is None:
            return cap
        target = s.memory_share * self.loaded.spec.kv_bytes(len(self.context), 2)
        fixed, per_token = self.zoom_costs()

        def left() -> int:
            return int((target - spans.resident_bytes() - fixed) // per_token)

        if left() < STARVED_SHARE * spans.span_tokens:
            spans.place_sketch(spans.sketch_dims // 2)
            cap = s.budget or left()
        return max(MIN_ZOOM, min(cap, left()))

    def zoom_costs(self) -> tuple[int, float]:
        """Bytes an answer's zoom takes before its first token, and per token of budget
        (:meth:`SpanMemory.zoom_bytes`)."""
        fixed = self.spans.zoom_bytes(0)
        return fixed, (self.spans.zoom_bytes(1024) - fixed) / 1024

    def max_band(self) -> int:
        """Books: the most zoomed tokens per KV head (half of the reading window after the
        sinks, :func:`~sekv_core.config.reading_window`)."""
        return (reading_window(self.loaded.spec.window) - self.spans.n_sinks) // 2

    def question_position(self) -> int:
        """RoPE position of the question's first token (books: after the sinks and the band)."""
        if not self.spans.bounded:
            return len(self.context)
        return self.spans.n_sinks + self.max_band()

    def begin_answer(self) -> ZoomPolicy:
        """A new answer's policy (kept as :attr:`policy`), the memory's pools and counters
        cleared."""
        self.policy = self.new_policy()
        self.spans.clear()
        return self.policy

    def generate(
        self,
        question_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling | None = None,
        forcing: Forcing | None = None,
    ) -> Iterator[int]:
        model, device, spans = self.loaded.model, self.loaded.device, self.spans
        policy = self.begin_answer()
        with sekv_attention(model):  # switched once per answer (the switch walks all modules)
            if spans.bounded:  # a book: zoomed tokens are packed right before the question
                self.policy = policy = self.pin_passages(question_ids, policy)
                start = policy.pool_end
            else:
                start = len(self.context)  # local tokens continue after the document's
            local = DynamicCache(config=model.config)
            self.step = step = PositionedStep(
                model, local, start, device, sekv_memory=spans, sekv_policy=policy
            )
            stop = stop_ids(self.loaded.tokenizer)
            yield from decode_tokens(step, question_ids, stop, max_new_tokens, sampling, forcing)

    def pin_passages(self, question_ids: list[int], first: ZoomPolicy) -> ZoomPolicy:
        """Books, two-stage routing (:mod:`sekv_core.passages`): read the question once with
        per-layer routing (``first``), rank spans by the attention its tokens paid them beyond
        what the neutral question pays, by their sentence's BM25 score for the question's words
        and by its meaning (the cosine of its embedding and the question's), fuse the rankings;
        returns the answer's policy: the passages around the best pinned for every layer and
        KV head, packed before the question, the best last."""
        spans = self.spans
        baseline = self.neutral_attention(first)
        first.attribute = False  # the answer's sources come from the passages' reading
        asked = question_attention(self.loaded, spans, question_ids, first)
        question = self.question_text(question_ids)
        words, covered = self.word_scores(question)
        rankings = [passages.specific(asked, baseline), words]
        # meaning finds a question asked in other words; one a sentence says in its own words
        # is found by them, and the embedder's near misses would only crowd its passage
        meaning = self.meaning_scores(question) if covered < passages.WORDS_FOUND else None
        if meaning is not None:
            rankings.append(meaning.to(asked.device))
        scores = passages.fuse(*rankings)
        # a budget asked for is the passages' size too: tokens every layer and KV head reads
        budget = min(self.settings.budget or self.settings.passages, self.max_band())
        if self.settings.memory_share is not None:
            budget = min(budget, first.budget)  # what the memory target leaves the zoom
        chosen = passages.choose(scores, self.span_sentences(), spans.lengths, budget)
        tokens = int(spans.lengths[chosen.to(spans.lengths.device)].sum())
        return ZoomPolicy(
            router=first.router,
            budget=tokens,
            margin=first.margin,
            neighbours=first.neighbours,
            observer=self.observer,
            attribute=self.settings.sources,
            pinned=chosen.to(scores.device),
            pinned_scores=scores,
            pool_end=spans.n_sinks + tokens,
            placement=passages.placement(chosen, scores).to(spans.device),  # best last
        )

    def neutral_attention(self, policy: ZoomPolicy) -> torch.Tensor:
        """(N,) what the neutral question pays each span (:mod:`.book_reading`), read once per
        session and zoom budget."""
        if self.neutral is None or self.neutral[0] != policy.budget:
            self.neutral = (policy.budget, neutral_attention(self.loaded, self.spans, policy))
        return self.neutral[1]

    def question_text(self, question_ids: list[int]) -> str:
        """The question as the user wrote it (its chat template taken off)."""
        return question_text(self.loaded.tokenizer, self.loaded.template, question_ids)

    def word_scores(self, question: str) -> tuple[torch.Tensor, float]:
        """(N,) BM25 of each span's sentence for the question's words (index built once), and
        how much of the question the best sentence says (:func:`.book_reading.word_scores`)."""
        if self.sentence_words is None:
            self.sentence_words = LexicalIndex(passages.sentence_texts(self.document.text))
        return word_scores(self.sentence_words, self.span_sentences(), question)

    def meaning_scores(self, question: str) -> torch.Tensor | None:
        """(N,) the cosine of each span's sentence and the question (None: no embeddings)."""
        return None if self.meaning is None else self.meaning.scores(question)

    def span_sentences(self) -> torch.Tensor:
        """(N,) sentence index of each span (:func:`sekv_core.passages.span_sentences`)."""
        if self.sentences is None:
            offsets = self.store.trace["offsets"]
            first_chars = offsets[self.spans.starts.long(), 0].numpy()
            self.sentences = passages.span_sentences(self.document.text, first_chars)
        return self.sentences

    def memory(self) -> dict[str, int]:
        resident = self.spans.resident_bytes()
        local = self.loaded.spec.kv_bytes(self.local_tokens, 2)
        return {
            "resident_bytes": resident + self.spans.peak_cached_bytes,
            "resident_tier_bytes": resident,
            "zoom_peak_bytes": self.spans.peak_cached_bytes,
            "local_window_bytes": local,
            "offloaded_bytes": self.store.tier.decoded_bytes,  # records in host memory now
            "store_bytes": self.store.manifest["bytes"]["store"],  # the store's files on disk
        }

    def store_info(self) -> dict[str, Any]:
        return {"path": str(self.store.path), "cache_hit": self.cache_hit}

    def routing(self) -> dict[str, Any]:
        """Routing summary of the last answer."""
        p = self.policy
        if p is None:
            return {}
        t = p.trace
        out: dict[str, Any] = {
            "router": p.router.name,
            "router_file": str(self.trained.path) if self.trained is not None else None,
            "budget": p.budget,
            "sketch_dims": self.spans.routed_dims,
            "margin": p.margin,
            "neighbours": p.neighbours,
            "zoomed_tokens_max": t.zoomed_tokens_max,
            "reconstructions": self.spans.reconstructions,
            # share of (layer, KV head, span) triples zoomed at least once for the answer
            "zoom_rate": round(t.zoom_rate, 4),
        }
        if p.pinned is not None:  # a book: the passages every layer read
            out["passages"] = {"spans": int(p.pinned.sum()), "tokens": p.budget}
        return out

    def answer_attention(self) -> torch.Tensor | None:
        answer = self.policy.trace.answer if self.policy is not None else None
        return answer[..., :-1] if answer is not None else None

    def explain(self, start: int, end: int) -> dict[str, Any]:
        """See :meth:`sekv_core.zoom.trace.ZoomTrace.explain` (a book's passages rank by the
        question's attention that chose them)."""
        t = self.policy.trace if self.policy is not None else None
        if t is None:
            return {}
        inside = ((self.spans.starts < end) & (self.spans.ends > start)).nonzero()[:, 0]
        return t.explain(inside, self.policy.pinned_scores)

    def zoom_trace(self) -> list[dict[str, Any]]:
        if self.policy is None:
            return []
        return zoom_rows(self.policy.trace.spans(), self.spans, self.store.trace, self.document)


def zoom_rows(
    traced: list[dict], spans: SpanMemory, trace: dict[str, torch.Tensor], document: Document
) -> list[dict[str, Any]]:
    """The zoom trace's rows (``ZoomTrace.spans``) with each span's tokens, page and a preview
    of its text, the spans the answer read most first."""
    pages, offsets = trace["pages"], trace["offsets"]
    out = []
    for z in traced:
        s, e = int(spans.starts[z["span"]]), int(spans.ends[z["span"]])
        c0, c1 = int(offsets[s][0]), int(offsets[e - 1][1])
        preview = " ".join(document.text[c0:c1].split())
        out.append(
            {
                "span": z["span"],
                "start": s,
                "end": e,
                "page": int(pages[s]),
                "layers": z["layers"],
                "heads": z["heads"],
                "attention": round(z["attention"], 5),
                "score": round(z["score"], 3),
                "threshold": round(z["threshold"], 3),
                "preview": preview[:PREVIEW_CHARS] + ("…" if len(preview) > PREVIEW_CHARS else ""),
            }
        )
    out.sort(key=lambda z: -z["attention"])
    return out
