"""Prompt assembly: the document once, the question after, through the model's chat template.

The prompt is split into a *context* (template head + document) that can be prefilled and stored
once, and a *question part* (template middle + question + template tail) appended per question.
A chat's question part also carries its earlier turns: the conversation is rendered through the
chat template as real earlier user and assistant turns, and cut after the document, so the head
(and every stored context) stays the same. Token ids of the document come with their character
offsets so tokens map back to pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
    range of document token ``i`` in the document text.
    """

    ids: list[int]
    doc_start: int
    offsets: list[tuple[int, int]]

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


def encode_context(tokenizer: Any, template: Template, document_text: str) -> Context:
    """Tokenise template head + document, keeping document character offsets."""
    head = tokenizer(template.head, add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None and getattr(tokenizer, "add_bos_token", False):
        if not head or head[0] != tokenizer.bos_token_id:
            head = [tokenizer.bos_token_id, *head]
    enc = tokenizer(document_text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = [tuple(o) for o in enc["offset_mapping"]]
    return Context(ids=list(head) + list(enc["input_ids"]), doc_start=len(head), offsets=offsets)


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
