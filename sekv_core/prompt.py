"""Prompt assembly: the document once, the question after, through the model's chat template.

The prompt is split into a *context* (template head + document) that can be prefilled and stored
once, and a *question part* (template middle + question + template tail) appended per question.
Token ids of the document come with their character offsets so tokens map back to pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SYSTEM_PROMPT = (
    "You answer questions about the document below using only its content. Answer briefly."
)
_DOC = "\x00SEKV_DOCUMENT\x00"
_QUESTION = "\x00SEKV_QUESTION\x00"


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
    user = f"Document:\n{_DOC}\n\nQuestion: {_QUESTION}"
    if not getattr(tokenizer, "chat_template", None):
        return _cut(f"{SYSTEM_PROMPT}\n\n{user}\nAnswer:")
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": user},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception:  # templates that reject a system turn (e.g. Mistral's)
        messages = [{"role": "user", "content": f"{SYSTEM_PROMPT}\n\n{user}"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return _cut(text)


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


def encode_question(tokenizer: Any, template: Template, question: str) -> list[int]:
    """Token ids that follow the context: template middle + question + assistant opening."""
    text = f"{template.middle}{question.strip()}{template.tail}"
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


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
