"""The answering session: a loaded model, one document, one method; many questions."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .config import MethodSettings, check_int, check_question, exceeds_window
from .decode import Forcing, TextStream
from .documents import Document, token_pages
from .errors import SekvError
from .methods import METHODS, PrefillSlot
from .models import LoadedModel
from .prefill import Progress
from .prompt import Context, Turn, encode_context, encode_question
from .sampling import Sampling
from .sources import answer_sources, sentence_ends

MAX_NEW_TOKENS = 128  # an answer's length cap (tokens) when none is given


@dataclass(frozen=True)
class AskOptions:
    """How one question is answered: at most ``max_new_tokens`` answer tokens, greedily or
    under ``sampling``; ``on_text`` receives text deltas as they are decoded. The answer ends
    before the first of the ``stop`` strings, and where it would repeat a sentence it already
    wrote unless ``allow_repeats`` (:class:`sekv_core.decode.TextStream`). ``history``: a
    chat's earlier (question, answer) turns, read before the question
    (:class:`sekv_core.conversation.Conversation` keeps them within the window). ``forcing``:
    feed its tokens as the answer and record each step's log-probabilities into it
    (:class:`sekv_core.decode.Forcing`, benchmarks). A misused field raises TypeError or
    ValueError naming it when the options are made, before any work is done."""

    max_new_tokens: int = MAX_NEW_TOKENS
    on_text: Callable[[str], None] | None = None
    sampling: Sampling | None = None
    stop: Sequence[str] = ()
    history: Sequence[Turn] = ()
    allow_repeats: bool = False
    forcing: Forcing | None = None

    def __post_init__(self) -> None:
        check_int("max_new_tokens", self.max_new_tokens, 1)
        if self.sampling is not None and not isinstance(self.sampling, Sampling):
            raise TypeError(f"sampling must be a Sampling or None, not {self.sampling!r:.60}")
        stop = self.stop
        if isinstance(stop, str) or not all(isinstance(s, str) for s in stop):
            raise TypeError(f"stop must be a sequence of str, not {stop!r:.60}")
        if self.on_text is not None and not callable(self.on_text):
            raise TypeError(f"on_text must be callable or None, not {self.on_text!r:.60}")


@dataclass
class Answer:
    """One answered question, with everything the CLI's --json contract reports."""

    answer: str
    method: str
    model: str
    document: dict[str, Any]
    memory: dict[str, int]
    timings: dict[str, float]
    store: dict[str, Any]
    sources: list[dict[str, Any]] = field(default_factory=list)  # see sekv_core.sources
    zoom: list[dict[str, Any]] = field(default_factory=list)
    routing: dict[str, Any] = field(default_factory=dict)
    tokens_generated: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def check_window(
    loaded: LoadedModel, document: Document, context: Context, books: bool = False
) -> None:
    """Refuse documents that do not fit the model's window with room for a question, unless
    the method reads ``books`` (streamed into a span store with bounded positions)."""
    window = loaded.spec.window
    if exceeds_window(window, len(context)) and not books:
        tokens = len(context) - context.doc_start
        raise SekvError(
            f"{document.path.name!r} is {tokens:,} tokens; {loaded.model_id} reads at most "
            f"{window:,} tokens including the question and answer; split the document, use "
            "--method sekv (it streams long documents) or a model with a longer window"
        )


def answer_room(window: int, room: int, question_tokens: int) -> int:
    """Answer tokens left in a ``window`` whose ``room`` after the context holds a question
    part of ``question_tokens`` (an error when none are)."""
    left = room - question_tokens
    if left < 1:
        raise SekvError(
            f"question too long: {question_tokens} tokens leave no room in the "
            f"{window:,}-token window; shorten it"
        )
    return left


def stream_answer(
    tokens: Iterable[int], stream: TextStream, on_text: Callable[[str], None] | None = None
) -> tuple[float | None, float]:
    """Push answer ``tokens`` through ``stream`` until they end or it stops, handing its text
    deltas to ``on_text``. Returns the seconds to the first token (None: no token) and to the
    end."""
    start = time.perf_counter()
    first_token_s = None
    for token in tokens:
        if first_token_s is None:
            first_token_s = time.perf_counter() - start
        delta = stream.push(token)
        if delta and on_text:
            on_text(delta)
        if stream.stopped:
            break
    rest = stream.flush()
    if rest and on_text:
        on_text(rest)
    return first_token_s, time.perf_counter() - start


def answer_timings(
    prepare_s: float, first_token_s: float | None, answer_s: float, n: int
) -> dict[str, float]:
    """An answer's timings (seconds; ``n`` tokens decoded), as :class:`Answer` reports them."""
    decode_s = answer_s - (first_token_s or answer_s)
    return {
        "total_s": round(prepare_s + answer_s, 4),
        "prepare_s": round(prepare_s, 4),
        "first_token_s": round(prepare_s + (first_token_s or answer_s), 4),
        "answer_s": round(answer_s, 4),
        "decode_tokens_per_s": round((n - 1) / decode_s, 2) if n > 1 and decode_s > 0 else 0.0,
    }


class Session:
    """Prepares ``document`` for ``method`` once; :meth:`ask` answers questions from it.

    ``prefills``: a slot shared with other sessions over the same document (benchmarks), so
    that methods prefilling its full cache do it once (:mod:`sekv_core.methods.shared_prefill`).
    ``context``: the document's tokens when the caller has them (:func:`encode_context` of it
    under the model's chat template), else they are found here.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        document: Document,
        method: str = "sekv",
        settings: MethodSettings | None = None,
        progress: Progress | None = None,
        prefills: PrefillSlot | None = None,
        context: Context | None = None,
    ) -> None:
        if method not in METHODS:
            raise SekvError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
        self.loaded, self.document = loaded, document
        with loaded.lock:  # the model and its tokenizer serve one caller at a time
            tokenizer = loaded.tokenizer
            if context is None:
                context = encode_context(tokenizer, loaded.template, document.text)
            self.context = context
            self.doc_tokens = len(self.context) - self.context.doc_start
            check_window(loaded, document, self.context, METHODS[method].reads_books)
            self.pages = token_pages(document, self.context.offsets)
            settings = settings or MethodSettings()
            self.method = METHODS[method](loaded, document, self.context, settings, prefills)
            start = time.perf_counter()
            self.method.prepare(progress)
            self.prepare_s = time.perf_counter() - start
        self._prepared_pending = True  # the first answer reports the preparation time
        self._sentence_ends = None  # sekv_core.sources.sentence_ends of the document

    def ask(self, question: str, max_new_tokens: int = MAX_NEW_TOKENS, **options: Any) -> Answer:
        """Answer ``question`` (:meth:`answer`) under ``AskOptions(max_new_tokens, **options)``."""
        return self.answer(question, AskOptions(max_new_tokens, **options))

    def answer(self, question: str, options: AskOptions) -> Answer:
        """Answer ``question`` as ``options`` say (see :class:`AskOptions`), within the window
        left after the document."""
        check_question(question)
        with self.loaded.lock:  # one answer at a time per model (see LoadedModel)
            tokenizer, spec = self.loaded.tokenizer, self.loaded.spec
            q_ids = self.question_ids(question, options.history)
            limit = min(options.max_new_tokens, answer_room(spec.window, self.room(), len(q_ids)))
            stream = TextStream(tokenizer, options.stop, options.allow_repeats)
            tokens = self.method.generate(q_ids, limit, options.sampling, options.forcing)
            first_token_s, answer_s = stream_answer(tokens, stream, options.on_text)
            n = len(stream.ids)
            timings = answer_timings(self.take_prepare_s(), first_token_s, answer_s, n)
            memory = dict(self.method.memory())
            # fp16: every share's unit
            memory["full_kv_bytes"] = spec.kv_bytes(len(self.context), 2)
            memory["resident_share"] = round(memory["resident_bytes"] / memory["full_kv_bytes"], 5)
            text = stream.text.strip()
            return Answer(
                answer=text,
                method=self.method.name,
                model=self.loaded.model_id,
                document=self.document_info(),
                memory=memory,
                timings=timings,
                store=self.method.store_info(),
                sources=self.sources(text),
                zoom=self.method.zoom_trace(),
                routing=self.method.routing(),
                tokens_generated=n,
            )

    def question_ids(self, question: str, history: Sequence[Turn] = ()) -> list[int]:
        """The question part of the prompt: ``history``'s turns, then ``question``."""
        with self.loaded.lock:
            return encode_question(self.loaded.tokenizer, self.loaded.template, question, history)

    def take_prepare_s(self) -> float:
        """The preparation time, for the first answer to report (0 for later ones)."""
        prepare_s = self.prepare_s if self._prepared_pending else 0.0
        self._prepared_pending = False
        return prepare_s

    def room(self, question: str = "") -> int:
        """Window tokens left after the document for the question part and the answer (the
        same for every ``question``; a collection's depends on where it routes it:
        :meth:`sekv_core.api.Library.room`)."""
        return self.loaded.spec.window - self.method.question_position()

    def sources(self, answer: str) -> list[dict[str, Any]]:
        """The last answer's sources (:mod:`sekv_core.sources`), each with what the method did
        for it (``zoom``: see :meth:`Method.explain`)."""
        attention = self.method.answer_attention()
        if attention is None or not answer:
            return []
        if self._sentence_ends is None:  # the document's, once per session
            self._sentence_ends = sentence_ends(self.document.text)
        found = answer_sources(
            attention, self.document, self.context, self.pages, answer, ends=self._sentence_ends
        )
        out = []
        for source in found:
            row = source.to_json()
            if facts := self.method.explain(source.start, source.end):
                row["zoom"] = facts
            out.append(row)
        return out

    def document_info(self) -> dict[str, Any]:
        doc = self.document
        return {
            "path": str(doc.path),
            "sha256": doc.sha256,
            "tokens": self.doc_tokens,
            "pages": doc.pages,
        }
