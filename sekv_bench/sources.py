"""Sources: does an answer's first source hold the answer, on the right page — SeKV beside full KV.

Documents: the sample documents with their ground truth (``.qa.json``: answer string and page),
and generated haystacks (``needle`` and ``multikey`` facts at several depths) typeset as PDFs, so
that the planted fact sits on one page of several. Each method answers every question twice on
the same session, once with sources recorded and once without, in alternating order: the answers
are the same (greedy), and the decode speeds side by side say what recording sources costs.

Reported per method, over the answers that are correct: the share whose first source contains
the ground-truth answer string, and whose first source is on the page holding it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sekv_core.config import MethodSettings
from sekv_core.documents import Document, load_document
from sekv_core.engine import Answer, Session
from sekv_core.errors import SekvError
from sekv_core.models import LoadedModel

from .rows import markdown_table
from .score import normalize
from .tasks import make_sample, qa_samples

TASKS = ("needle", "multikey")  # one answer string each: the source either holds it or not


@dataclass(frozen=True)
class Item:
    """One question on one document, with its answer string and the page that holds it."""

    document: str
    path: Path
    question: str
    answer: str
    page: int | None


def qa_items(tokenizer) -> list[Item]:
    """The sample documents' ground truth (pages where the ``.qa.json`` gives them)."""
    items = []
    for sample in qa_samples(tokenizer):
        assert sample.source is not None
        truth = json.loads(sample.source.with_suffix(".qa.json").read_text())
        for entry in truth:
            items.append(
                Item(
                    sample.source.name,
                    sample.source,
                    entry["question"],
                    entry["answer"],
                    entry.get("page"),
                )
            )
    return items


def haystack_items(
    tokenizer, lengths: list[int], depths: list[float], seeds: list[int], out: Path
) -> list[Item]:
    """Generated haystacks written as PDFs under ``out``; the fact's page from the PDF's text."""
    items = []
    out.mkdir(parents=True, exist_ok=True)
    for task in TASKS:
        for length in lengths:
            for depth in depths:
                for seed in seeds:
                    sample = make_sample(task, tokenizer, length, depth, seed)
                    path = write_pdf(sample.text, out / f"{sample.name}.pdf")
                    document = load_document(path)
                    for q in sample.questions:
                        (answer,) = q.answers
                        items.append(
                            Item(path.name, path, q.question, answer, fact_page(document, answer))
                        )
    return items


def write_pdf(text: str, path: Path) -> Path:
    """``text`` typeset on A4 pages (paragraphs kept), with fpdf2 (a dev dependency)."""
    try:
        from fpdf import FPDF
    except ImportError as exc:
        raise SekvError(
            "the sources benchmark typesets its haystacks with fpdf2: pip install fpdf2"
        ) from exc
    pdf = FPDF()
    pdf.set_auto_page_break(True, margin=15)
    pdf.add_page()
    pdf.set_font("Helvetica", size=11)
    pdf.multi_cell(0, 5, text.encode("latin-1", "replace").decode("latin-1"))
    pdf.output(str(path))
    return path


def fact_page(document: Document, answer: str) -> int | None:
    """The page where ``answer`` first occurs in the document's text (None if it does not)."""
    at = document.text.lower().find(answer.lower())
    return document.page_of_char(at) if at >= 0 else None


def bench_sources(
    loaded: LoadedModel,
    items: list[Item],
    methods: list[str],
    settings: MethodSettings,
    max_new_tokens: int = 48,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per (question, method): correctness, first source's hit and page, decode speed
    with and without sources."""
    rows = []
    by_document: dict[Path, list[Item]] = {}
    for item in items:
        by_document.setdefault(item.path, []).append(item)
    turn = 0
    for path, questions in by_document.items():
        document = load_document(path)
        for method in methods:
            session = Session(loaded, document, method, replace(settings, sources=True))
            for item in questions:
                turn += 1
                with_sources, without = answer_twice(session, item.question, max_new_tokens, turn)
                row = score_row(item, method, with_sources, without)
                rows.append(row)
                if on_row:
                    on_row(row)
    return rows


def answer_twice(
    session: Session, question: str, max_new_tokens: int, turn: int
) -> tuple[Answer, Answer]:
    """The answer with sources recorded and without, the first of the two alternating."""
    answers = {}
    for sources in (True, False) if turn % 2 else (False, True):
        session.method.settings.sources = sources
        answers[sources] = session.ask(question, max_new_tokens)
    session.method.settings.sources = True
    return answers[True], answers[False]


def decode_seconds(answer: Answer) -> float:
    rate = answer.timings["decode_tokens_per_s"]
    return (answer.tokens_generated - 1) / rate if rate else 0.0


def score_row(item: Item, method: str, answer: Answer, plain: Answer) -> dict[str, Any]:
    truth = normalize(item.answer)
    first = answer.sources[0] if answer.sources else None
    return {
        "document": item.document,
        "question": item.question,
        "method": method,
        "correct": truth in normalize(answer.answer),
        "same_answer": answer.answer == plain.answer,
        "first_has_answer": first is not None
        and normalize(item.answer) in normalize(first["text"]),
        "page": item.page,
        "first_page": first["page"] if first else None,
        "first_share": first["share"] if first else None,
        "sources": len(answer.sources),
        "answer": answer.answer,
        "decode_s": [round(decode_seconds(answer), 4), round(decode_seconds(plain), 4)],
        "tokens": answer.tokens_generated,
    }


def summary(rows: list[dict[str, Any]], methods: list[str]) -> list[dict[str, Any]]:
    """Per method: answers correct; among them, first source holding the answer and on its page;
    decode speed with sources / without."""
    out = []
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        right = [r for r in mine if r["correct"]]
        paged = [r for r in right if r["page"] is not None]
        tokens = sum(r["tokens"] - 1 for r in mine)
        on, off = (sum(r["decode_s"][i] for r in mine) for i in (0, 1))
        out.append(
            {
                "method": method,
                "correct": f"{len(right)}/{len(mine)}",
                "first source holds the answer": _share(
                    sum(r["first_has_answer"] for r in right), len(right)
                ),  # fmt: skip
                "first source on its page": _share(
                    sum(r["first_page"] == r["page"] for r in paged), len(paged)
                ),
                "tok/s with sources": round(tokens / on, 2) if on else 0.0,
                "tok/s without": round(tokens / off, 2) if off else 0.0,
                "ratio": round(off / on, 3) if on else 0.0,
                "same answers": f"{sum(r['same_answer'] for r in mine)}/{len(mine)}",
            }
        )
    return out


def _share(hits: int, total: int) -> str:
    return f"{hits / total:.2f} ({hits}/{total})" if total else "–"


def write_results(out: Path, rows: list[dict], table: list[dict], meta: dict) -> None:
    """results.json (every row) and results.md (the summary table) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({**meta, "summary": table, "rows": rows}, indent=1)
    )
    (out / "results.md").write_text("\n".join(markdown_table(table)) + "\n")
