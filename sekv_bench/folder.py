"""The folder benchmark: a generated collection of reports, facts planted in some, each asked
across the whole collection.

:func:`write_collection` writes ``documents`` reports (:func:`sekv_bench.book.make_book`, each
its own seed) of ``tokens / documents`` tokens each; ``facts`` of them, spread over the
collection, hold one planted fact each (names, codes, sums), asked in its own words and
paraphrased (the paraphrase shares only the place name, which every report names).
:func:`bench_folder` then measures, in one run and side by side:

- SeKV over the collection (:class:`sekv_core.api.Library`: routed to one document, answered
  from its store): answers right, the fact's document among the sources, a source holding the
  fact's sentence, the document routed to;
- ``retrieve`` over the same collection (BM25 passages of every document filling the window)
  and full KV given the fact's own document alone (the model's ceiling): answers right;
- the collection's ingest, then the first answer of a library opened on the ingested
  collection (opening: reading, tokenising and indexing every document; first token: routing,
  loading one store and reading the question); resident bytes per document, per 1K tokens, held
  while answering and for every store at once;
- a document added to the ingested collection: how many documents a new library reads again.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sekv_core.api import Library
from sekv_core.collection import select_documents
from sekv_core.config import MethodSettings
from sekv_core.engine import Answer, Session
from sekv_core.models import LoadedModel

from .book import Fact, make_book, planted_facts
from .score import is_correct

KINDS = ("exact", "paraphrased")
METHODS = ("sekv", "retrieve", "full (own document)")


@dataclass(frozen=True)
class Planted:
    """A fact and the file that holds it."""

    fact: Fact
    path: Path


def write_collection(
    tokenizer: Any, folder: Path, documents: int, tokens: int, facts: int, seed: int = 0
) -> list[Planted]:
    """``documents`` reports of about ``tokens / documents`` tokens in ``folder`` (the same
    bytes for the same arguments: a rerun finds their stores); fact ``k`` planted in report
    ``(k + 1/2) * documents / facts``, at a depth of its own."""
    folder.mkdir(parents=True, exist_ok=True)
    per_document = max(1, tokens // documents)
    holders = {int((k + 0.5) * documents / facts): k for k in range(facts)}
    chosen = planted_facts(facts, seed)
    out = []
    for i in range(documents):
        planted = []
        if i in holders:
            k = holders[i]
            planted = [replace(chosen[k], depth=round(0.1 + 0.8 * ((k * 0.618) % 1), 3))]
        path = folder / f"report-{i:03d}.md"
        text = make_book(tokenizer, per_document, planted, seed=seed * 100_003 + i)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        out += [Planted(f, path) for f in planted]
    return out


def fact_chars(text: str, fact: Fact) -> tuple[int, int]:
    """Characters of the fact's sentence in the document text ((-1, -1) if not found)."""
    start = text.find(fact.fact.rstrip("."))
    return (start, start + len(fact.fact)) if start >= 0 else (-1, -1)


def found(answer: Answer, path: Path, chars: tuple[int, int]) -> tuple[bool, bool]:
    """Whether a source is in the fact's document, and whether one holds part of its
    sentence."""
    here = [s for s in answer.sources if s.get("path", answer.document["path"]) == str(path)]
    sentence = any(s["chars"][0] < chars[1] and s["chars"][1] > chars[0] for s in here)
    return bool(here), sentence


def bench_folder(
    loaded: LoadedModel,
    out: Path,
    documents: int = 50,
    tokens: int = 300_000,
    facts: int | None = None,
    settings: MethodSettings | None = None,
    max_new_tokens: int = 32,
    seed: int = 0,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    progress: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark on a collection written under ``out/collection``; rows go to
    ``out/results.jsonl``, the summary to ``out/summary.json`` and ``out/results.md``."""
    settings = settings or MethodSettings()
    facts = facts or max(1, documents // 4)
    folder = out / "collection"
    planted = write_collection(loaded.tokenizer, folder, documents, tokens, facts, seed)

    start = time.perf_counter()
    ingested = Library(loaded, select_documents([folder]), "sekv", settings, progress)
    ingest_s = time.perf_counter() - start
    built = sum(not d["store"]["cache_hit"] for d in ingested.documents())
    del ingested

    start = time.perf_counter()  # a library opened on the ingested collection
    library = Library(loaded, select_documents([folder]), "sekv", settings)
    open_s = time.perf_counter() - start
    retrieve = Library(loaded, select_documents([folder]), "retrieve", settings)

    rows, first_token_s = [], None
    with (out / "results.jsonl").open("w") as results:
        for p in planted:
            alone = Session(loaded, library_document(library, p.path), "full", settings)
            chars = fact_chars(alone.document.text, p.fact)
            for kind, question in zip(KINDS, (p.fact.question, p.fact.paraphrase), strict=True):
                answers = {
                    "sekv": library.ask(question, max_new_tokens),
                    "retrieve": retrieve.ask(question, max_new_tokens),
                    "full (own document)": alone.ask(question, max_new_tokens),
                }
                sekv, full = answers["sekv"], answers["full (own document)"]
                if first_token_s is None:
                    first_token_s = sekv.timings["first_token_s"]
                row = {
                    "document": p.path.name,
                    "kind": kind,
                    "question": question,
                    "expected": p.fact.answer,
                    "routed": Path(sekv.document["path"]).name,
                    "routed_right": sekv.document["path"] == str(p.path),
                    "sources_document": found(sekv, p.path, chars)[0],
                    "sources_sentence": found(sekv, p.path, chars)[1],
                    "full_sources_sentence": found(full, p.path, chars)[1],
                    "held_resident_bytes": sekv.memory["held_resident_bytes"],
                    "resident_bytes": sekv.memory["resident_bytes"],
                }
                for method, answer in answers.items():
                    row[f"{method}_correct"] = is_correct(answer.answer, [p.fact.answer], "all")
                    row[f"{method}_answer"] = answer.answer[:80]
                    row[f"{method}_first_token_s"] = answer.timings["first_token_s"]
                    row[f"{method}_resident_bytes"] = answer.memory["resident_bytes"]
                rows.append(row)
                results.write(json.dumps(row) + "\n")
                if on_row:
                    on_row(row)
            del alone

    added = added_document(loaded, folder, settings)
    summary = summarize(rows, library, ingest_s, built, open_s, first_token_s, added)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "results.md").write_text(markdown(summary))
    return {"rows": rows, "summary": summary}


def library_document(library: Library, path: Path):
    """The library's document read from ``path``."""
    return next(e.document for e in library.entries if e.document.path == path)


def added_document(loaded: LoadedModel, folder: Path, settings: MethodSettings) -> dict[str, Any]:
    """Add one new report to the ingested collection and open it again: the documents read
    (built) and the seconds it took; the report and its store are removed afterwards."""
    path = folder / "added-report.md"
    stamp = time.time_ns()  # a new document each run: its store is never found
    path.write_text(f"# Added report {stamp}\n\nThe added report was filed at {stamp}.\n")
    try:
        start = time.perf_counter()
        library = Library(loaded, select_documents([folder]), "sekv", settings)
        seconds = time.perf_counter() - start
        rows = library.documents()
        read = [Path(r["path"]).name for r in rows if not r["store"]["cache_hit"]]
        mine = next(r["store"]["path"] for r in rows if r["path"] == str(path))
    finally:
        path.unlink(missing_ok=True)
    shutil.rmtree(mine, ignore_errors=True)
    return {"documents": len(rows), "read": read, "seconds": round(seconds, 2)}


def share(rows: list[dict[str, Any]], key: str) -> str:
    return f"{sum(bool(r[key]) for r in rows)}/{len(rows)}"


def summarize(
    rows: list[dict[str, Any]],
    library: Library,
    ingest_s: float,
    built: int,
    open_s: float,
    first_token_s: float | None,
    added: dict[str, Any],
) -> dict[str, Any]:
    """Every figure of the run, per kind of question where it differs."""
    docs = library.documents()
    in_all = library.memory()
    resident = [d["memory"]["resident_bytes"] for d in docs]
    by_kind = {k: [r for r in rows if r["kind"] == k] for k in KINDS}
    out: dict[str, Any] = {
        "documents": len(docs),
        "tokens": in_all["tokens"],
        "questions": len(rows),
        "ingest_s": round(ingest_s, 1),
        "ingest_built": built,
        "open_s": round(open_s, 2),
        "first_token_s": first_token_s,
        "resident_per_document_bytes": round(statistics.mean(resident)),
        "resident_per_1k_tokens_bytes": round(1000 * sum(resident) / in_all["tokens"]),
        "resident_all_bytes": in_all["resident_all_bytes"],
        "held_while_answering_bytes": max((r["held_resident_bytes"] for r in rows), default=0),
        "full_kv_all_bytes": in_all["full_kv_bytes"],
        "added": added,
    }
    for kind, part in by_kind.items():
        out[kind] = {
            "routed_right": share(part, "routed_right"),
            "sources_document": share(part, "sources_document"),
            "sources_sentence": share(part, "sources_sentence"),
            "full_sources_sentence": share(part, "full_sources_sentence"),
            **{f"{m}_correct": share(part, f"{m}_correct") for m in METHODS},
        }
    for m in METHODS:
        times = [r[f"{m}_first_token_s"] for r in rows]
        memory = [r[f"{m}_resident_bytes"] for r in rows]
        out[f"{m}_first_token_s_median"] = round(statistics.median(times), 2) if times else None
        out[f"{m}_resident_bytes_mean"] = round(statistics.mean(memory)) if memory else None
    return out


def mib(n: float | None) -> str:
    return "–" if n is None else f"{n / 2**20:,.2f} MiB"


def markdown(s: dict[str, Any]) -> str:
    """The summary as one side-by-side table and the collection's figures."""
    e, p = s["exact"], s["paraphrased"]
    lines = [
        f"# Folder: {s['documents']} documents, {s['tokens']:,} tokens, {s['questions']} "
        "questions (exact words / paraphrased)",
        "",
        "| | sekv (routed) | retrieve (collection) | full KV (own document) |",
        "|---|---|---|---|",
        "| answers right | "
        + " | ".join(f"{e[f'{m}_correct']} / {p[f'{m}_correct']}" for m in METHODS)
        + " |",
        f"| routed to the fact's document | {e['routed_right']} / {p['routed_right']} | – | – |",
        f"| fact's document among sources | {e['sources_document']} / "
        f"{p['sources_document']} | – | – |",
        f"| a source holds the fact's sentence | {e['sources_sentence']} / "
        f"{p['sources_sentence']} | – | {e['full_sources_sentence']} / "
        f"{p['full_sources_sentence']} |",
        "| first token, median | "
        + " | ".join(f"{s[f'{m}_first_token_s_median']} s" for m in METHODS)
        + " |",
        "| resident while answering, mean | "
        + " | ".join(mib(s[f"{m}_resident_bytes_mean"]) for m in METHODS)
        + " |",
        "",
        f"- ingest: {s['ingest_s']} s ({s['ingest_built']} of {s['documents']} documents read; "
        "the others' stores found)",
        f"- opening the ingested collection: {s['open_s']} s (read, tokenise, index every "
        f"document); its first answer's first token: {s['first_token_s']} s more",
        f"- resident tier: {mib(s['resident_per_document_bytes'])} per document, "
        f"{s['resident_per_1k_tokens_bytes']:,} bytes per 1K tokens; held while answering at "
        f"most {mib(s['held_while_answering_bytes'])}, every store at once "
        f"{mib(s['resident_all_bytes'])}; full KV of all {mib(s['full_kv_all_bytes'])}",
        f"- one document added: {len(s['added']['read'])} of {s['added']['documents']} read "
        f"({', '.join(s['added']['read']) or 'none'}) in {s['added']['seconds']} s",
    ]
    return "\n".join(lines) + "\n"
