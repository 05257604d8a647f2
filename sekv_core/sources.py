"""An answer's sources: the passages of the document its tokens drew on.

A method that can say where its answer's attention went keeps, per layer and KV head, the most
attention any query predicting an answer token paid each context token (``attention`` (L, H, T);
SeKV: its exact attention over the zoomed tokens, full KV: over the whole document). A token's
weight is its highest such attention in any layer and head: a head that copies a name or looks a
fact up puts a peak on its words, while the attention that every step spreads over the same
filler (the end of the document, sinks) stays low. A sentence (:func:`sentence_ends`) weighs what
its tokens weigh; the heaviest sentences are the sources, neighbouring ones joined into one
passage. A source's ``share`` is its part of the whole document's weight (the shares of all
sources sum to at most 1).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .collection import joined_starts
from .documents import Document
from .prompt import Context

MAX_SOURCES = 5
RELATIVE = 0.25  # a sentence is a source while it holds this share of the first one's mass
QUOTE_CHARS = 240  # a longer passage is quoted around its most attended token
PUNCTUATION_END = re.compile(r"[.!?]+[\"'’”)\]]*(?=\s|$)")
PARAGRAPH_END = re.compile(r"\n[ \t]*\n\s*|\n(?=[ \t]*(?:[-*•#>|]|\d+[.)])\s)")
SHORT_LINE = 0.6  # a line this much shorter than the document's typical line ends a sentence
WORD = re.compile(r"[^\W_]+(?:['’.-][^\W_]+)*")
# words too common to be worth emphasising where answer and source share them
COMMON = frozenset(
    "the and for are was were with that this from have has had not but its their there they "
    "his her she him you your our who what when where which how why all any can will would "
    "into than then them these those been being also only over such each per".split()
)


@dataclass(frozen=True)
class Source:
    """One passage the answer drew on: document tokens [start, end) (context positions, as the
    zoom trace counts them), characters [chars[0], chars[1]) of the document text, its page
    (that of its most attended token), the quoted ``text`` and the answer's words it contains."""

    page: int
    start: int
    end: int
    chars: tuple[int, int]
    text: str
    share: float
    matched: tuple[str, ...]

    def to_json(self) -> dict:
        out = asdict(self)
        out["chars"], out["matched"] = list(self.chars), list(self.matched)
        return out


def answer_sources(
    attention: torch.Tensor,
    document: Document,
    context: Context,
    pages: list[int],
    answer: str,
    limit: int = MAX_SOURCES,
    ends: np.ndarray | None = None,
) -> list[Source]:
    """The answer's sources, best first (none when it paid the document no attention)."""
    mass = token_weights(attention, context)
    total = float(mass.sum())
    if not len(mass) or total <= 0:
        return []
    offsets = np.asarray(context.offsets, dtype=np.int64).reshape(-1, 2)  # (Td, 2)
    ends = sentence_ends(document.text) if ends is None else ends  # a session keeps them
    sentence = np.searchsorted(ends, offsets[:, 0], side="right")  # (Td,)
    per_sentence = np.bincount(sentence, weights=mass)
    order = np.argsort(-per_sentence, kind="stable")
    best = per_sentence[order[0]]
    picked = [int(s) for s in order[:limit] if per_sentence[s] >= RELATIVE * best]
    sources = []
    for group in _runs(sorted(picked)):  # neighbouring sentences: one passage
        tokens = np.flatnonzero((sentence >= group[0]) & (sentence <= group[-1]))
        first, last = int(tokens[0]), int(tokens[-1])
        peak = first + int(np.argmax(mass[first : last + 1]))
        c0, c1 = int(offsets[first, 0]), int(offsets[last, 1])
        text = quote(document.text, c0, c1, int(offsets[peak, 0]))
        sources.append(
            Source(
                page=int(pages[peak]),
                start=context.doc_start + first,
                end=context.doc_start + last + 1,
                chars=(c0, c1),
                text=text,
                share=round(float(mass[first : last + 1].sum()) / total, 4),
                matched=shared_words(text, answer),
            )
        )
    sources.sort(key=lambda s: -s.share)
    return sources


def in_documents(rows: list[dict], documents: list[Document], answer: str) -> None:
    """Sources found in :func:`~sekv_core.collection.joined_document` of ``documents`` (JSON
    rows), placed in the document holding each one's page: its ``path``, its ``page`` and
    ``chars`` in that document (a passage running past the document's edge cut there and
    quoted again). ``start`` and ``end`` stay positions in the joined context."""
    starts = joined_starts(documents)
    pages = np.cumsum([0] + [d.pages for d in documents])  # pages before each document
    for row in rows:
        k = int(np.searchsorted(pages, row["page"], side="left")) - 1
        doc, at = documents[k], starts[k]
        c0, c1 = row["chars"][0] - at, row["chars"][1] - at
        a, b = max(0, c0), min(len(doc.text), c1)
        if (a, b) != (c0, c1):
            row["text"] = quote(doc.text, a, b, a)
            row["matched"] = list(shared_words(row["text"], answer))
        row.update(path=str(doc.path), page=int(row["page"] - pages[k]), chars=[a, b])


def token_weights(attention: torch.Tensor, context: Context) -> np.ndarray:
    """(Td,) float64 each document token's weight: the most attention ``attention``
    (L, H, T) gave it in any layer and head."""
    return attention[..., context.doc_start :].float().amax(dim=(0, 1)).cpu().double().numpy()


def sentence_ends(text: str) -> np.ndarray:
    """Character offsets where the sentences of ``text`` end, ascending.

    Sentences end at ``.``, ``!`` or ``?`` (closing quotes and brackets included) before white
    space, at a blank line, before a list item or heading, and at the end of a line much shorter
    than the document's typical one (a heading or a paragraph's last line). Any other line break
    is a wrapped line: text from PDFs and hard-wrapped files keeps its sentences whole.
    """
    ends = {m.end() for m in PUNCTUATION_END.finditer(text)}
    ends.update(m.end() for m in PARAGRAPH_END.finditer(text))
    lines = [(m.start(), m.end()) for m in re.finditer(r"[^\n]*\n", text)]
    widths = [e - s - 1 for s, e in lines if e - s > 20]
    if widths:
        short = SHORT_LINE * float(np.median(widths))
        ends.update(e for s, e in lines if e - s - 1 < short)
    ends.add(len(text))
    return np.array(sorted(ends), dtype=np.int64)


def _runs(values: list[int]) -> list[list[int]]:
    """Consecutive integers grouped: [1, 2, 5] -> [[1, 2], [5]]."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return runs


def quote(text: str, c0: int, c1: int, peak: int, width: int = QUOTE_CHARS) -> str:
    """text[c0:c1] on one line; a longer one cut to ``width`` characters around ``peak`` at word
    boundaries, each cut side marked with an ellipsis."""
    if c1 - c0 > width:
        lo = max(c0, min(peak - width // 3, c1 - width))
        hi = min(c1, lo + width)
        if lo > c0:
            lo = _word_start(text, lo)
        if hi < c1:
            hi = _word_end(text, hi, lo)
        body = " ".join(text[lo:hi].split())
        return ("…" if lo > c0 else "") + body + ("…" if hi < c1 else "")
    return " ".join(text[c0:c1].split())


def _word_start(text: str, i: int) -> int:
    while i < len(text) and not text[i - 1].isspace():
        i += 1
    return i


def _word_end(text: str, i: int, lo: int) -> int:
    while i > lo and not text[i].isspace():
        i -= 1
    return i


def shared_words(text: str, answer: str) -> tuple[str, ...]:
    """The words of ``text`` that the answer uses too (case-insensitive; common words and
    single letters left out), in the order ``text`` has them, each once."""
    said = {w.lower() for w in WORD.findall(answer)}
    out: dict[str, None] = {}
    for w in WORD.findall(text):
        low = w.lower()
        if low in said and low not in COMMON and (len(w) > 2 or w.isdigit()):
            out.setdefault(w, None)
    return tuple(out)
