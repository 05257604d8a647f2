"""Several documents read together: one question answered from the span stores of a few
documents in ONE softmax ("parallel context windows", Ratner et al., 2023).

Each document's memory routes by its own policy (zoom budget, pools, trace) and keeps its tokens
at their own positions; the question and the answer come after the longest context, so every
RoPE distance stays inside the window (:class:`sekv_core.zoom.attention.MemoryGroup`). The
first (best) document is shifted on to end right before the question, as it would when read
alone: a small model attends most to what is near the question. Every context begins with the
same chat template head, which the first memory holds: the others' copies are left out of the
softmax.

A document beyond the window (a book: its store is *bounded*) is not read together:
:func:`ask_together` refuses it with :class:`NotTogether`, and the caller answers from the best
document alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from transformers import DynamicCache

from .config import check_question
from .decode import PositionedStep, TextStream, decode_tokens
from .engine import Answer, AskOptions, Session, answer_room, answer_timings, stream_answer
from .errors import SekvError
from .methods import SeKV
from .models import LoadedModel
from .prompt import stop_ids
from .sources import MAX_SOURCES, RELATIVE, token_weights
from .zoom.attention import GroupMember, MemoryGroup, sekv_attention


class NotTogether(SekvError):
    """The sessions cannot be read in one answer (a book beyond the window, another method,
    another model, a session given twice, none at all)."""


def ask_together(sessions: Sequence[Session], question: str, options: AskOptions) -> Answer:
    """Answer ``question`` as ``options`` say (:class:`AskOptions`) from the documents of
    ``sessions`` (prepared SeKV sessions over one loaded model, the best document first) read
    together: every layer attends in one softmax over all their memories and the question and
    answer tokens, which come after the longest context (the first document shifted to end
    there). With one session the answer is the one :meth:`Session.answer` gives.

    The answer's ``document``, ``store`` and ``routing`` are the first session's (``routing``
    adds ``read_together``: the paths read); ``sources`` and ``zoom`` rows of every document
    carry its ``path``, ordered as one document's are (a source's ``share`` is its part of all
    the documents' weight: one softmax makes them comparable); ``memory`` sums the documents'
    (one local window). Raises :class:`NotTogether` where the sessions cannot be read together
    (the caller may answer from the first alone).
    """
    methods = _sekv_methods(sessions)
    check_question(question)
    first = sessions[0]
    loaded, window = first.loaded, first.loaded.spec.window
    q_ids = first.question_ids(question, options.history)
    group = _group(sessions, methods)
    room = window - group.local_start
    limit = min(options.max_new_tokens, answer_room(window, room, len(q_ids)))
    stream = TextStream(loaded.tokenizer, options.stop, options.allow_repeats)
    tokens = _decode(loaded, methods, group, q_ids, limit, options)
    first_token_s, answer_s = stream_answer(tokens, stream, options.on_text)
    n = len(stream.ids)
    prepare_s = sum(s.take_prepare_s() for s in sessions)
    text = stream.text.strip()
    routing = first.method.routing()
    routing["read_together"] = [str(s.document.path) for s in sessions]
    return Answer(
        answer=text,
        method=first.method.name,
        model=loaded.model_id,
        document=first.document_info(),
        memory=_memory(sessions),
        timings=answer_timings(prepare_s, first_token_s, answer_s, n),
        store=first.method.store_info(),
        sources=_sources(sessions, text),
        zoom=_zoom(sessions),
        routing=routing,
        tokens_generated=n,
    )


def _sekv_methods(sessions: Sequence[Session]) -> list[SeKV]:
    """The sessions' SeKV methods, or :class:`NotTogether` naming why they cannot be read
    together."""
    if not sessions:
        raise NotTogether("sessions: no document to read")
    if len({id(s) for s in sessions}) < len(sessions):
        raise NotTogether("sessions: a document is given twice")
    methods = []
    for s in sessions:
        name = s.document.path.name
        if not isinstance(s.method, SeKV):
            raise NotTogether(f"sessions: {name!r} is answered by {s.method.name!r}, not sekv")
        if s.loaded is not sessions[0].loaded:
            raise NotTogether(f"sessions: {name!r} is read by another model")
        if s.method.spans.bounded:
            raise NotTogether(
                f"sessions: {name!r} is beyond the model's window (a book's store): "
                "it is answered alone"
            )
        methods.append(s.method)
    return methods


def _group(sessions: Sequence[Session], methods: list[SeKV]) -> MemoryGroup:
    """The memories of ``sessions`` as one group, each with a new answer's policy: the first
    shifted to end where the longest context ends, and the only one to read the template's
    head."""
    longest = max(len(s.context) for s in sessions)
    return MemoryGroup(
        tuple(
            GroupMember(
                m.spans,
                m.begin_answer(),
                head=s.context.doc_start,
                read_head=i == 0,
                shift=longest - len(s.context) if i == 0 else 0,
            )
            for i, (s, m) in enumerate(zip(sessions, methods, strict=True))
        )
    )


def _decode(
    loaded: LoadedModel,
    methods: list[SeKV],
    group: MemoryGroup,
    q_ids: list[int],
    limit: int,
    options: AskOptions,
) -> Iterator[int]:
    """At most ``limit`` answer tokens over ``group`` (the local tokens after its contexts),
    chosen as ``options`` say."""
    model = loaded.model
    with sekv_attention(model):
        local = DynamicCache(config=model.config)
        step = PositionedStep(model, local, group.local_start, loaded.device, sekv_group=group)
        for method in methods:  # each reports the answer's local window
            method.step = step
        stop = stop_ids(loaded.tokenizer)
        yield from decode_tokens(step, q_ids, stop, limit, options.sampling, options.forcing)


def _sources(sessions: Sequence[Session], answer: str) -> list[dict[str, Any]]:
    """Each document's sources (:meth:`Session.sources`, from its own answer attention) with
    its ``path``, merged: shares rescaled to all the documents' weight, best first, at most
    ``MAX_SOURCES``; a sentence holding less than ``RELATIVE`` of the best one's share is not
    cited, whichever document holds it (one softmax: the rule one document's sources follow)."""
    found: list[list[dict[str, Any]]] = []
    weights: list[float] = []
    for s in sessions:
        attention = s.method.answer_attention()
        rows = s.sources(answer)
        for row in rows:
            row["path"] = str(s.document.path)
        found.append(rows)
        weights.append(float(token_weights(attention, s.context).sum()) if rows else 0.0)
    total = sum(weights)
    if total <= 0:
        return []
    for rows, weight in zip(found, weights, strict=True):
        for row in rows:
            row["share"] = round(row["share"] * weight / total, 4)
    best = max(rows[0]["share"] for rows in found if rows)
    merged = [row for rows in found for row in rows if row["share"] >= RELATIVE * best]
    merged.sort(key=lambda row: -row["share"])
    return merged[:MAX_SOURCES]


def _zoom(sessions: Sequence[Session]) -> list[dict[str, Any]]:
    """Every document's zoom rows with its ``path``, the spans the answer read most first."""
    rows = []
    for s in sessions:
        for row in s.method.zoom_trace():
            row["path"] = str(s.document.path)
            rows.append(row)
    rows.sort(key=lambda row: -row["attention"])
    return rows


def _memory(sessions: Sequence[Session]) -> dict[str, Any]:
    """The documents' memory summed (their resident tiers and zoom peaks, offloaded records,
    store files and fp16 full KV), the one local window they share counted once."""
    total: dict[str, Any] = {}
    for s in sessions:
        for key, value in s.method.memory().items():
            total[key] = total.get(key, 0) + value
    spec = sessions[0].loaded.spec
    total["local_window_bytes"] = sessions[0].method.memory()["local_window_bytes"]
    total["full_kv_bytes"] = sum(spec.kv_bytes(len(s.context), 2) for s in sessions)
    total["resident_share"] = round(total["resident_bytes"] / total["full_kv_bytes"], 5)
    return total
