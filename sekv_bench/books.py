"""The book task: generated books beyond the model window, SeKV against what a user would do
instead with the same model (BM25 retrieval into the window, or the first window's worth).

Per length and seed one book (:func:`sekv_bench.book.make_book`) holds ``facts`` planted facts
spread over its whole length; each is asked twice: with the fact's own words (names, numbers)
and paraphrased (the question shares only the place name with the fact, and place names are
common throughout the book). Every method answers every question of a book from one prepared
session; rows say which kind of question each answer was.
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sekv_core.config import MethodSettings
from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.models import LoadedModel

from .book import fact_chars, peak_rss_bytes, planted_facts, write_book
from .rows import resident_share
from .score import is_correct

KINDS = ("exact", "paraphrased")


def words_shared(a: str, b: str) -> set[str]:
    """Lower-cased words two texts have in common."""
    return set(re.findall(r"\w+", a.lower())) & set(re.findall(r"\w+", b.lower()))


def bench_books(
    loaded: LoadedModel,
    lengths: list[int],
    seeds: list[int],
    methods: list[str],
    out: Path,
    facts: int = 6,
    settings: MethodSettings | None = None,
    max_new_tokens: int = 32,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Answer every book question with every method; rows go to ``out/results.jsonl``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "books").mkdir(exist_ok=True)
    results = out / "results.jsonl"
    results.write_text("")
    rows = []
    for length in lengths:
        for seed in seeds:
            planted = planted_facts(facts, seed)
            path = write_book(loaded.tokenizer, out / "books" / f"book-{length}-s{seed}.md",
                              length, planted, seed)  # fmt: skip
            document = load_document(path)
            for method in methods:
                t0 = time.perf_counter()
                session = Session(loaded, document, method, settings or MethodSettings())
                prepare_s = time.perf_counter() - t0
                for fact in planted:
                    for kind, question in zip(KINDS, (fact.question, fact.paraphrase), strict=True):
                        answer = session.ask(question, max_new_tokens)
                        row = {
                            "length": length,
                            "tokens": session.doc_tokens,
                            "seed": seed,
                            "method": method,
                            "kind": kind,
                            "depth": round(fact.depth, 3),
                            "question": question,
                            "expected": fact.answer,
                            "answer": answer.answer[:160],
                            "correct": is_correct(answer.answer, [fact.answer], "all"),
                            "source_holds": holds(answer.sources, fact_chars(document.text, fact)),
                            "resident_share": resident_share(answer.memory, 4),
                            "prepare_s": round(prepare_s, 1),
                            "answer_s": answer.timings["answer_s"],
                            "decode_tps": answer.timings["decode_tokens_per_s"],
                            "peak_rss_bytes": peak_rss_bytes(),
                        }
                        rows.append(row)
                        with results.open("a") as f:
                            f.write(json.dumps(row) + "\n")
                        if on_row:
                            on_row(row)
                prepare_s = 0.0  # the next questions reuse the session
    (out / "results.md").write_text(markdown(rows))
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Correct answers per method, length and kind of question."""
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        cells[(r["method"], r["length"], r["kind"])].append(r)
    return [
        {
            "method": m,
            "length": n,
            "kind": k,
            "correct": sum(r["correct"] for r in part),
            "source_holds": sum(r.get("source_holds", False) for r in part),
            "questions": len(part),
            "resident_share": round(sum(r["resident_share"] for r in part) / len(part), 4),
        }
        for (m, n, k), part in sorted(cells.items())
    ]


def markdown(rows: list[dict[str, Any]]) -> str:
    """One table: correct / asked per method and length, exact-word and paraphrased apart."""
    summary = summarize(rows)
    lengths = sorted({s["length"] for s in summary})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    head = ["method", *(f"{n // 1000}K {k}" for n in lengths for k in KINDS), "resident"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        cells = []
        for n in lengths:
            for k in KINDS:
                s = next((x for x in summary if (x["method"], x["length"], x["kind"]) == (m, n, k)),
                         None)  # fmt: skip
                cells.append(f"{s['correct']}/{s['questions']} ({s['source_holds']})" if s else "–")
        shares = [x["resident_share"] for x in summary if x["method"] == m]
        cells.append(f"{min(shares):.1%}–{max(shares):.1%}" if shares else "–")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return (
        "# Books: correct answers (exact-word / paraphrased questions; in brackets: a source "
        "holds the fact's sentence)\n\n" + "\n".join(lines) + "\n"
    )


def holds(sources: list[dict[str, Any]], chars: tuple[int, int]) -> bool:
    """Whether a source overlaps the characters of the fact's sentence."""
    return any(s["chars"][0] < chars[1] and s["chars"][1] > chars[0] for s in sources)
