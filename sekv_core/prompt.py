"""Prompt assembly: the document once, the question after, through the model's chat template.

The prompt is split into a *context* (template head + document) that can be prefilled and stored
once, and a *question part* (template middle + question + template tail) appended per question.
A chat's question part also carries its earlier turns: the conversation is rendered through the
chat template as real earlier user and assistant turns, and cut after the document, so the head
(and every stored context) stays the same. Token ids of the document come with their character
offsets so tokens map back to pages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import SekvError

SYSTEM_PROMPT = (
    "You answer questions about the document below using only its content. Answer briefly."
)
_DOC = "\x00SEKV_DOCUMENT\x00"
_QUESTION = "\x00SEKV_QUESTION\x00"
Turn = tuple[str, str]  # an earlier (question, answer) of a chat


@dataclass(frozen=True)
class Template:
    """The chat template cut around the document and the question."""

    head: str  # before the document
    middle: str  # between the document and the question
    tail: str  # after the question (ends with the assistant turn's opening)


@dataclass(frozen=True)
class Context:
    """Token ids of the prompt up to the end of the document.

    ``ids[doc_start:]`` are the document's tokens; ``offsets[i]`` is the (start, end) character
    range of document token ``i`` in the document text (an array (T_doc, 2) from
    :func:`encode_context`; any sequence of pairs will do).
    """

    ids: list[int]
    doc_start: int
    offsets: Sequence[tuple[int, int]] | np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


def chat_template(tokenizer: Any) -> Template:
    """Cut the tokenizer's chat template around placeholders (plain format without one)."""
    if not getattr(tokenizer, "chat_template", None):
        return _cut(f"{SYSTEM_PROMPT}\n\n{_user(_QUESTION)}\nAnswer:")
    try:
        text = _render(tokenizer, _messages(True, _QUESTION))
    except Exception:  # templates that reject a system turn (e.g. Mistral's)
        text = _render(tokenizer, _messages(False, _QUESTION))
    return _cut(text)


def _user(question: str) -> str:
    """The first user turn: the document, then the first question."""
    return f"Document:\n{_DOC}\n\nQuestion: {question}"


def _messages(system: bool, question: str, history: Sequence[Turn] = ()) -> list[dict[str, str]]:
    """The conversation: the system prompt (its own turn, or leading the first user turn), the
    document with the first question, then each earlier answer and the next question."""
    questions = [q.strip() for q, _ in history] + [question]
    first = _user(questions[0])
    if system:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    else:
        messages, first = [], f"{SYSTEM_PROMPT}\n\n{first}"
    messages.append({"role": "user", "content": first})
    for (_, answer), asked in zip(history, questions[1:], strict=True):
        messages.append({"role": "assistant", "content": answer.strip()})
        messages.append({"role": "user", "content": asked})
    return messages


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _cut(text: str) -> Template:
    head, rest = text.split(_DOC)
    middle, tail = rest.split(_QUESTION)
    return Template(head, middle, tail)


Progress = Callable[[int, int], None]
"""progress(characters tokenised, characters in all)."""


def encode_context(
    tokenizer: Any, template: Template, document_text: str, progress: Progress | None = None
) -> Context:
    """Tokenise template head + document, keeping document character offsets.

    The document is tokenised piece by piece (:func:`encode_text`): the tokens are those of the
    whole text, in memory bounded by a piece; ``progress`` is told after each piece of a
    document longer than one.
    """
    head = tokenizer(template.head, add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None and getattr(tokenizer, "add_bos_token", False):
        if not head or head[0] != tokenizer.bos_token_id:
            head = [tokenizer.bos_token_id, *head]
    ids, offsets = encode_text(tokenizer, document_text, progress)
    return Context(ids=list(head) + ids, doc_start=len(head), offsets=offsets)


PIECE_CHARS = 1 << 18  # characters tokenised at a time
OVERLAP_CHARS = 1 << 10  # a piece's last characters, read again at the start of the next


def encode_text(
    tokenizer: Any, text: str, progress: Progress | None = None, piece: int = PIECE_CHARS
) -> tuple[list[int], np.ndarray]:
    """Token ids of ``text`` and each token's (start, end) character offsets (T, 2), as the
    tokenizer gives them for the whole text, found ``piece`` characters at a time.

    A piece's tokens are kept up to ``OVERLAP_CHARS`` before its end (a cut may fall inside a
    word); the next piece starts a little before that, at one of those tokens, and its tokens
    take over where both pieces agree on the tokens up to the kept end: from there on the
    whole text's tokenization is the same. Where the two never agree (a word longer than the
    overlap), the piece is read again twice as long.
    """
    n = len(text)
    ids: list[int] = []
    starts: list[np.ndarray] = []
    done, size = 0, max(piece, 4 * OVERLAP_CHARS)  # text[:done] is tokenised
    carried = None  # the next piece's tokens from ``done`` on, and where it ends, read already
    while done < n:
        if carried is not None:
            piece_ids, piece_offsets, end = carried
            carried = None
        else:
            end = min(n, done + size)
            piece_ids, piece_offsets = _encode(tokenizer, text, done, end)
        if end == n:
            ids += piece_ids
            starts.append(piece_offsets)
            done = n
        else:
            kept = int(np.searchsorted(piece_offsets[:, 1], end - OVERLAP_CHARS, side="right"))
            first = max(int(np.searchsorted(piece_offsets[:, 0], end - 2 * OVERLAP_CHARS)), 1)
            if first >= kept:  # too few tokens in the overlap to agree on: a longer piece
                size *= 2
                continue
            nxt = int(piece_offsets[first, 0])
            next_end = min(n, nxt + size)
            next_ids, next_offsets = _encode(tokenizer, text, nxt, next_end)
            at = _agreement(piece_ids, piece_offsets, first, kept, next_ids, next_offsets)
            if at is None:
                size *= 2
                continue
            mine, theirs = at
            ids += piece_ids[:mine]
            starts.append(piece_offsets[:mine])
            done = int(piece_offsets[mine, 0])
            carried = (next_ids[theirs:], next_offsets[theirs:], next_end)
            size = max(piece, 4 * OVERLAP_CHARS)
        if progress is not None and n > piece:
            progress(done, n)
    dtype = np.int32 if n < 2**31 else np.int64
    offsets = np.concatenate(starts).astype(dtype) if starts else np.zeros((0, 2), dtype)
    return ids, offsets.reshape(-1, 2)


def _encode(tokenizer: Any, text: str, start: int, end: int) -> tuple[list[int], np.ndarray]:
    """The tokens of ``text[start:end]``: ids, and offsets (T, 2) into ``text``."""
    enc = tokenizer(text[start:end], add_special_tokens=False, return_offsets_mapping=True)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2) + start
    return list(enc["input_ids"]), offsets


def _agreement(
    ids: list[int],
    offsets: np.ndarray,
    first: int,
    kept: int,
    next_ids: list[int],
    next_offsets: np.ndarray,
) -> tuple[int, int] | None:
    """The first token ``t`` of ``ids[first:kept]`` from which the next piece's tokens are the
    same (ids and offsets) up to ``kept``: (t, its index in the next piece); None if none.
    Only a token that begins a character can be one (the bytes of one character may be
    several tokens with the same offsets)."""
    index: dict[int, int] = {}
    for i, s in enumerate(next_offsets[:, 0].tolist()):
        index.setdefault(s, i)  # the first token at each offset
    for t in range(first, kept):
        if offsets[t, 0] == offsets[t - 1, 0]:
            continue
        i = index.get(int(offsets[t, 0]))
        if i is None or i + kept - t > len(next_ids):
            continue
        if next_ids[i : i + kept - t] == ids[t:kept] and np.array_equal(
            next_offsets[i : i + kept - t], offsets[t:kept]
        ):
            return t, i
    return None


def encode_question(
    tokenizer: Any, template: Template, question: str, history: Sequence[Turn] = ()
) -> list[int]:
    """Token ids that follow the context: template middle + question + assistant opening; with a
    chat's ``history`` of earlier (question, answer) turns, those turns first, oldest first."""
    if history:
        text = _after_document(tokenizer, template, question.strip(), history)
    else:
        text = f"{template.middle}{question.strip()}{template.tail}"
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def question_text(tokenizer: Any, template: Template, question_ids: Sequence[int]) -> str:
    """What the model reads after the document, as text, the template around it removed: the
    question (in a chat, after the earlier turns)."""
    text = tokenizer.decode(list(question_ids))
    return text.removeprefix(template.middle).removesuffix(template.tail)


def _after_document(
    tokenizer: Any, template: Template, question: str, history: Sequence[Turn]
) -> str:
    """The conversation after the document: in the plain format "Question: …\nAnswer: …" lines,
    else the chat template's rendering of the earlier turns, cut after the document. Raises
    SekvError for a template that would change the text before the document."""
    if not getattr(tokenizer, "chat_template", None):
        earlier = "".join(f"{q.strip()}{template.tail} {a.strip()}\nQuestion: " for q, a in history)
        return f"{template.middle}{earlier}{question}{template.tail}"
    for system in (True, False):  # the layout chat_template chose keeps the head
        try:
            head, _, rest = _render(tokenizer, _messages(system, question, history)).partition(_DOC)
        except Exception:
            continue
        if head == template.head:
            return rest
    raise SekvError(
        "this model's chat template changes the prompt before the document when earlier turns "
        "are added, so a chat cannot keep them; /reset before each question"
    )


def stop_ids(tokenizer: Any) -> set[int]:
    """Token ids that end an answer (eos and the chat turn terminators the vocab knows)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<end_of_turn>"):
        if tok in vocab:
            ids.add(int(vocab[tok]))
    return ids
