"""The folder benchmark: a generated collection of reports, facts planted in some, each asked
across the whole collection.

:func:`write_collection` writes ``documents`` reports (:func:`sekv_bench.book.make_book`, each
its own seed) of ``tokens / documents`` tokens each; ``facts`` of them, spread over the
collection, hold one planted fact each (names, codes, sums), asked in its own words and
paraphrased (the paraphrase shares only the place name, which every report names). Pairs of
facts are also asked in one question (:data:`KINDS` ``two documents``): the answer needs a
fact from each of two files. :func:`bench_folder` then measures, in one run and side by side:

- SeKV over the collection (:class:`sekv_core.api.Library`: ranked by words and meaning, the
  best documents read together): answers right, the fact's documents among those read and
  among the sources, a source holding the fact's sentence, the document ranked first;
- ``retrieve`` over the same collection (BM25 passages of every document filling the window)
  and full KV given the fact's own document alone (the model's ceiling; for a two-document
  question the first fact's document): answers right;
- the first answer on the collection never opened before (index built, stores built only for
  the documents the question reads): seconds to its first token and what they went to; then
  the collection's ingest (every store), opening the indexed collection again (no document
  read), resident bytes per document, per 1K tokens, held while answering and for every store
  at once;
- a document added to the collection: how many files the index reads again when it opens.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sekv_core.api import Library
from sekv_core.collection import select_documents
from sekv_core.config import MethodSettings
from sekv_core.documents import load_document
from sekv_core.engine import Answer, Session
from sekv_core.models import LoadedModel

from .book import Fact, fact_chars, make_book, planted_facts
from .score import is_correct

KINDS = ("exact", "paraphrased", "two documents")
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


def found(answer: Answer, path: Path, chars: tuple[int, int]) -> tuple[bool, bool]:
    """Whether a source is in the fact's document, and whether one holds part of its
    sentence."""
    here = [s for s in answer.sources if s.get("path", answer.document["path"]) == str(path)]
    sentence = any(s["chars"][0] < chars[1] and s["chars"][1] > chars[0] for s in here)
    return bool(here), sentence


def questions(planted: list[Planted]) -> list[tuple[str, str, list[Planted]]]:
    """(kind, question, the facts it needs): each fact in its own words and paraphrased, and
    consecutive pairs of facts asked in one question."""
    out = []
    for p in planted:
        out += [("exact", p.fact.question, [p]), ("paraphrased", p.fact.paraphrase, [p])]
    for a, b in zip(planted[::2], planted[1::2], strict=False):
        both = (
            f"{a.fact.question.rstrip('?')}, and {b.fact.question[0].lower()}{b.fact.question[1:]}"
        )
        out.append(("two documents", both, [a, b]))
    return out


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
    ingest: bool = True,
) -> dict[str, Any]:
    """Run the benchmark on a collection written under ``out/collection``; rows go to
    ``out/results.jsonl``, the summary to ``out/summary.json`` and ``out/results.md``.
    ``ingest`` False: no store built before the questions (each question builds those it
    reads), and no ingest figure."""
    settings = settings or MethodSettings()
    facts = facts or max(2, documents // 4)
    folder = out / "collection"
    planted = write_collection(loaded.tokenizer, folder, documents, tokens, facts, seed)
    asked = questions(planted)

    start = time.perf_counter()  # never opened: index, then stores for what it reads
    fresh = Library(loaded, select_documents([folder]), "sekv", settings, progress)
    index_s = time.perf_counter() - start
    first = fresh.ask(asked[1][1], max_new_tokens)  # the first fact, paraphrased
    cold = {
        "index_s": round(index_s, 2),
        "first_token_s": round(index_s + first.timings["first_token_s"], 2),
        "route_s": first.timings.get("route_s"),
        "stores_built": sum(not d["store"]["cache_hit"] for d in fresh.documents() if d["store"]),
        "stores_s": first.timings["prepare_s"],
    }
    fresh.close()
    del fresh

    ingest_s, built = None, None
    if ingest:
        start = time.perf_counter()
        ingested = Library(loaded, select_documents([folder]), "sekv", settings, progress,
                           build_all=True)  # fmt: skip
        ingest_s = time.perf_counter() - start
        built = sum(not d["store"]["cache_hit"] for d in ingested.documents())
        ingested.close()
        del ingested

    start = time.perf_counter()  # a library opened on the ingested collection
    library = Library(loaded, select_documents([folder]), "sekv", settings)
    open_s = time.perf_counter() - start
    retrieve = Library(loaded, select_documents([folder]), "retrieve", settings)

    rows, first_token_s = [], None
    with (out / "results.jsonl").open("w") as results:
        for kind, question, needed in asked:
            alone = Session(loaded, load_document(needed[0].path), "full", settings)
            answers = {
                "sekv": library.ask(question, max_new_tokens),
                "retrieve": retrieve.ask(question, max_new_tokens),
                "full (own document)": alone.ask(question, max_new_tokens),
            }
            sekv, full = answers["sekv"], answers["full (own document)"]
            if first_token_s is None:
                first_token_s = sekv.timings["first_token_s"]
            read = sekv.routing.get("read_together", [sekv.document["path"]])
            where = [found(sekv, p.path, fact_chars(load_document(p.path).text, p.fact))
                     for p in needed]  # fmt: skip
            row = {
                "documents": [p.path.name for p in needed],
                "kind": kind,
                "question": question,
                "expected": [p.fact.answer for p in needed],
                "ranked_first": Path(sekv.document["path"]).name,
                "ranked_right": sekv.document["path"] == str(needed[0].path)
                or (len(needed) > 1 and sekv.document["path"] == str(needed[1].path)),
                "read": [Path(r).name for r in read],
                "read_right": all(str(p.path) in read for p in needed),
                "sources_document": all(w[0] for w in where),
                "sources_sentence": all(w[1] for w in where),
                "full_sources_sentence": found(
                    full, needed[0].path, fact_chars(alone.document.text, needed[0].fact)
                )[1],
                "held_resident_bytes": sekv.memory["held_resident_bytes"],
                "resident_bytes": sekv.memory["resident_bytes"],
            }
            expected = [p.fact.answer for p in needed]
            for method, answer in answers.items():
                row[f"{method}_correct"] = is_correct(answer.answer, expected, "all")
                row[f"{method}_answer"] = answer.answer[:80]
                row[f"{method}_first_token_s"] = answer.timings["first_token_s"]
                row[f"{method}_resident_bytes"] = answer.memory["resident_bytes"]
            rows.append(row)
            results.write(json.dumps(row) + "\n")
            if on_row:
                on_row(row)
            del alone

    added = added_document(loaded, folder, settings)
    summary = summarize(rows, library, ingest_s, built, open_s, first_token_s, added, cold)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "results.md").write_text(markdown(summary))
    return {"rows": rows, "summary": summary}


def added_document(loaded: LoadedModel, folder: Path, settings: MethodSettings) -> dict[str, Any]:
    """Add one new report to the collection and open it again: the files the index read (the
    others unchanged) and the seconds opening took; the report is removed afterwards."""
    path = folder / "added-report.md"
    stamp = time.time_ns()  # a new document each run: never indexed before
    path.write_text(f"# Added report {stamp}\n\nThe added report was filed at {stamp}.\n")
    try:
        start = time.perf_counter()
        library = Library(loaded, select_documents([folder]), "sekv", settings)
        seconds = time.perf_counter() - start
        documents, read = len(library.entries), library.synced.read
        library.close()
    finally:
        path.unlink(missing_ok=True)
    return {"documents": documents, "read": read, "seconds": round(seconds, 2)}


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
    cold: dict[str, Any],
) -> dict[str, Any]:
    """Every figure of the run, per kind of question where it differs."""
    docs = library.documents()
    in_all = library.memory()
    resident = [d["memory"]["resident_bytes"] for d in docs if "resident_bytes" in d["memory"]]
    by_kind = {k: [r for r in rows if r["kind"] == k] for k in KINDS}
    out: dict[str, Any] = {
        "documents": len(docs),
        "tokens": in_all["tokens"],
        "questions": len(rows),
        "ingest_s": None if ingest_s is None else round(ingest_s, 1),
        "ingest_built": built,
        "open_s": round(open_s, 2),
        "first_token_s": first_token_s,
        "resident_per_document_bytes": round(statistics.mean(resident)),
        "resident_per_1k_tokens_bytes": round(1000 * sum(resident) / max(1, in_all["tokens"])),
        "resident_all_bytes": in_all["resident_all_bytes"],
        "held_while_answering_bytes": max((r["held_resident_bytes"] for r in rows), default=0),
        "full_kv_all_bytes": in_all["full_kv_bytes"],
        "added": added,
        "cold": cold,
        "index": library.catalog.counts() if library.catalog else {},
    }
    for kind, part in by_kind.items():
        out[kind] = {
            "ranked_right": share(part, "ranked_right"),
            "read_right": share(part, "read_right"),
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
    kinds = [k for k in KINDS if s[k]["ranked_right"] != "0/0"]

    def cells(key: str) -> str:
        return " / ".join(s[k][key] for k in kinds)

    lines = [
        f"# Folder: {s['documents']} documents, {s['tokens']:,} tokens read, {s['questions']} "
        f"questions ({' / '.join(kinds)})",
        "",
        "| | sekv (ranked, read together) | retrieve (collection) | full KV (own document) |",
        "|---|---|---|---|",
        "| answers right | "
        + " | ".join(" / ".join(s[k][f"{m}_correct"] for k in kinds) for m in METHODS)
        + " |",
        f"| the fact's document ranked first | {cells('ranked_right')} | – | – |",
        f"| the facts' documents read | {cells('read_right')} | – | – |",
        f"| the facts' documents among sources | {cells('sources_document')} | – | – |",
        f"| a source holds each fact's sentence | {cells('sources_sentence')} | – | "
        f"{cells('full_sources_sentence')} |",
        "| first token, median | "
        + " | ".join(f"{s[f'{m}_first_token_s_median']} s" for m in METHODS)
        + " |",
        "| resident while answering, mean | "
        + " | ".join(mib(s[f"{m}_resident_bytes_mean"]) for m in METHODS)
        + " |",
        "",
        f"- first answer on the folder never opened: first token after {s['cold']['first_token_s']}"
        f" s (index {s['cold']['index_s']} s, {s['cold']['stores_built']} stores built in "
        f"{s['cold']['stores_s']} s, ranking {s['cold']['route_s']} s)",
        f"- ingest (every store): {s['ingest_s']} s ({s['ingest_built']} of {s['documents']} "
        "documents read; the others' stores found)"
        if s["ingest_s"] is not None
        else "- ingest: not run (each question built the stores it read)",
        f"- opening the ingested collection: {s['open_s']} s (the index checked, no document "
        f"read); its first answer's first token: {s['first_token_s']} s more",
        f"- the index: {s['index'].get('passages', 0):,} passages, "
        f"{s['index'].get('bytes', 0) / 2**20:.1f} MiB",
        f"- resident tier: {mib(s['resident_per_document_bytes'])} per document, "
        f"{s['resident_per_1k_tokens_bytes']:,} bytes per 1K tokens; held while answering at "
        f"most {mib(s['held_while_answering_bytes'])}, every store at once "
        f"{mib(s['resident_all_bytes'])}; full KV of all {mib(s['full_kv_all_bytes'])}",
        f"- one document added: the index read {s['added']['read']} of "
        f"{s['added']['documents']} files, opening took {s['added']['seconds']} s",
    ]
    return "\n".join(lines) + "\n"
