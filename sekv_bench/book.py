"""Books: a generated multi-chapter report with planted facts, and the book benchmark.

:func:`make_book` writes a report of any length (chapters and numbered sections of sentences
built from parts, no copied text) with facts planted at chosen depths, and returns the ground
truth (question, answer, depth). :func:`bench_book_ingest` streams a book into a span store and
reports peak RSS and tokens/s at 10 / 50 / 100% of it; :func:`bench_book_needles` asks, per
length, three needles planted at three depths of ONE book (one ingest, three questions), with
full KV beside it where the context fits the model window.
"""

from __future__ import annotations

import json
import random
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sekv_core.config import DEFAULT_BUDGET, MethodSettings, StoreSettings, exceeds_window
from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.ingest import open_or_build
from sekv_core.models import LoadedModel
from sekv_core.prompt import encode_context

from .haystack import NEEDLES, Needle, sentence
from .rows import resident_share

# each topic with words for it that share none of its own (paraphrased questions use them)
TOPICS = {
    "harbour works": "dock building",
    "water supply": "mains and taps",
    "school buildings": "classroom premises",
    "coastal defence": "shoreline protection",
    "public transport": "buses and trams",
    "parks and gardens": "green spaces",
    "the town archive": "historical records",
    "road maintenance": "street repairs",
    "the fishing fleet": "trawlers",
    "street lighting": "lamp posts",
    "the market hall": "indoor bazaar",
    "flood protection": "high-tide barriers",
}
PLACES = ["Carrick Bay", "Elmstead", "Port Avel", "Marrow Fen", "Linley", "Saltcote", "Wenholm"]
FIRST = ["Agnes", "Tomasz", "Rhiannon", "Kwame", "Ilse", "Desmond", "Yara", "Piotr", "Maeve"]
LAST = ["Hallorann", "Okonjo", "Vasquez", "Lindqvist", "Brennock", "Achterberg", "Szabo"]
DEPTHS = (0.1, 0.5, 0.9)
LENGTHS = (16_000, 32_000, 64_000, 128_000)


@dataclass(frozen=True)
class Fact:
    """A planted fact and its question; ``depth`` is its relative position in the book.

    ``paraphrase`` asks the same in other words: it shares only the place name with the fact
    sentence, and every place is named throughout the book, so lexical retrieval is not handed
    the answer."""

    fact: str
    question: str
    answer: str
    depth: float
    paraphrase: str = ""


def planted_facts(count: int, seed: int = 0) -> list[Fact]:
    """``count`` distinct facts (names, codes, numbers) spread evenly over the book."""
    rng = random.Random(seed)
    out = []
    topics = list(TOPICS)
    for i in range(count):
        place, topic = PLACES[i % len(PLACES)], topics[i % len(topics)]
        other = TOPICS[topic]
        depth = (i + 0.5) / count
        kind = i % 3
        if kind == 0:
            name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
            fact = Fact(
                f"The officer responsible for {topic} in {place} is {name}.",
                f"Who is the officer responsible for {topic} in {place}?",
                name,
                depth,
                f"Which official looks after {other} at {place}?",
            )
        elif kind == 1:
            code = f"{rng.choice('KLMRTV')}{rng.choice('AEIOU')}-{rng.randrange(1000, 9999)}"
            fact = Fact(
                f"The file reference of the {topic} survey for {place} is {code}.",
                f"What is the file reference of the {topic} survey for {place}?",
                code,
                depth,
                f"Under which record number is the study of {other} at {place} kept?",
            )
        else:
            number = rng.randrange(120, 980)
            fact = Fact(
                f"The {topic} budget of {place} was set at {number} thousand crowns.",
                f"At how many thousand crowns was the {topic} budget of {place} set?",
                str(number),
                depth,
                f"How much money did {place} allot to {other}?",
            )
        out.append(fact)
    return out


def needle_facts(depths: tuple[float, ...] = DEPTHS) -> list[Fact]:
    """The haystack needles (one per depth), as book facts."""
    needles: list[Needle] = [NEEDLES[i % len(NEEDLES)] for i in range(len(depths))]
    return [Fact(n.fact, n.question, n.answer, d) for n, d in zip(needles, depths, strict=True)]


def make_book(tokenizer, tokens: int, facts: list[Fact], seed: int = 0) -> str:
    """A report of about ``tokens`` tokens (``tokenizer``'s) in chapters and sections, each fact
    planted at its depth. Markdown headings; paragraphs of five generated sentences."""
    rng = random.Random(seed)
    paragraphs: list[str] = []
    count = 0
    while count < tokens:  # each paragraph also names a place (so place names are common)
        local = sentence(rng)
        local = f"In {rng.choice(PLACES)}, {local[0].lower()}{local[1:]}"
        para = " ".join([*(sentence(rng) for _ in range(4)), local])
        paragraphs.append(para)
        count += len(tokenizer(para, add_special_tokens=False)["input_ids"]) + 2
    for fact in sorted(facts, key=lambda f: -f.depth):  # deepest first: indices stay valid
        at = min(len(paragraphs) - 1, int(fact.depth * len(paragraphs)))
        words = paragraphs[at].split(". ")
        words.insert(len(words) // 2, fact.fact.rstrip("."))
        paragraphs[at] = ". ".join(words)
    out, per_section, per_chapter = [], 6, 8
    for i in range(0, len(paragraphs), per_section):
        section = i // per_section
        if section % per_chapter == 0:
            chapter = section // per_chapter + 1
            topic = list(TOPICS)[(chapter - 1) % len(TOPICS)]
            out.append(f"# Chapter {chapter}: {topic.capitalize()}")
        out.append(f"## Section {chapter}.{section % per_chapter + 1}")
        out.extend(paragraphs[i : i + per_section])
    return "\n\n".join(out)


def write_book(tokenizer, out: Path, tokens: int, facts: list[Fact], seed: int = 0) -> Path:
    """Write the book to ``out`` (.md) and its ground truth to ``out`` with .qa.json."""
    out.write_text(make_book(tokenizer, tokens, facts, seed))
    truth = [
        {"question": q, "answer": f.answer, "depth": f.depth}
        for f in facts
        for q in (f.question, f.paraphrase)
        if q
    ]
    out.with_suffix(".qa.json").write_text(json.dumps(truth, indent=1) + "\n")
    return out


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux: ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bench_book_ingest(
    loaded: LoadedModel, path: Path, settings: StoreSettings | None = None
) -> dict[str, Any]:
    """Stream ``path`` into a fresh span store: time, tokens/s at 10/50/100%, peak RSS, bytes."""
    settings = settings or StoreSettings()
    document = load_document(path)
    context = encode_context(loaded.tokenizer, loaded.template, document.text)
    rss_before = peak_rss_bytes()
    t0 = time.perf_counter()
    store, hit = open_or_build(loaded, document, context, settings)
    if hit:  # measure a cold build
        shutil.rmtree(store.path)
        t0 = time.perf_counter()
        store, _ = open_or_build(loaded, document, context, settings)
    seconds = time.perf_counter() - t0
    m = store.manifest
    b, stats = m["bytes"], m["stats"]
    return {
        "document": path.name,
        "tokens": len(context),
        "ingest_s": round(seconds, 1),
        "tokens_per_s": round(len(context) / seconds, 1),
        "tokens_per_s_at": m.get("stream", {}).get("tokens_per_s_at"),
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_rss_before_ingest_bytes": rss_before,
        "positions": m["positions"]["mode"],
        "max_position": m.get("stream", {}).get("max_position"),
        "window_peak_bytes": m.get("stream", {}).get("peak_window_bytes"),
        "resident_bytes": b["resident"],
        "offloaded_bytes": b["offloaded"],
        "full_kv_bytes": b["full_kv_fp16"],
        "resident_share": round(b["resident"] / b["full_kv_fp16"], 4),
        "anchors_pct": stats["anchors_pct"],
        "spans": stats["spans"],
        "timings": m["timings"],
    }


def bench_book_needles(
    loaded: LoadedModel,
    lengths: tuple[int, ...] = LENGTHS,
    depths: tuple[float, ...] = DEPTHS,
    budget: int = DEFAULT_BUDGET,
    max_new_tokens: int = 24,
    workdir: Path | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Per length: one book with a needle at each depth, three questions; full KV where the
    context fits the model window (else ``None``)."""
    rows = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for length in lengths:
            facts = needle_facts(depths)
            path = write_book(loaded.tokenizer, Path(tmp) / f"book-{length}.md", length, facts)
            doc = load_document(path)
            t0 = time.perf_counter()
            session = Session(loaded, doc, "sekv", MethodSettings(budget=budget))
            ingest_s = time.perf_counter() - t0
            fits = not exceeds_window(loaded.spec.window, len(session.context))
            full = Session(loaded, doc, "full") if fits else None
            for fact in facts:
                answer = session.ask(fact.question, max_new_tokens)
                row = {
                    "tokens": session.doc_tokens,
                    "depth": fact.depth,
                    "sekv_ok": fact.answer.lower() in answer.answer.lower(),
                    "sekv_answer": answer.answer[:60],
                    "needle_zoomed": read_fact(session, doc.text, fact, answer.zoom),
                    "ingest_s": round(ingest_s, 1),
                    "ingest_tokens_per_s_at": session.method.store.manifest.get("stream", {}).get(
                        "tokens_per_s_at"
                    ),
                    "peak_rss_bytes": peak_rss_bytes(),
                    "answer_s": answer.timings["answer_s"],
                    "resident_share": resident_share(answer.memory, 4),
                    "full_ok": None,
                }
                if full is not None:
                    reference = full.ask(fact.question, max_new_tokens)
                    row["full_ok"] = fact.answer.lower() in reference.answer.lower()
                rows.append(row)
                if progress:
                    progress(row)
    return rows


def read_fact(session: Session, text: str, fact: Fact, zoom: list[dict[str, Any]]) -> bool:
    """Whether the answer read any token of the planted fact's sentence (a zoomed span, or a
    book's passage, overlaps it)."""
    first = text.find(fact.fact.rstrip("."))
    if first < 0:
        return False
    last = first + len(fact.fact)
    context = session.context  # offsets: of document tokens; zoom rows: context positions
    tokens = [i for i, (a, b) in enumerate(context.offsets) if a < last and b > first and b > a]
    if not tokens:
        return False
    lo, hi = context.doc_start + min(tokens), context.doc_start + max(tokens) + 1
    return any(z["start"] < hi and z["end"] > lo for z in zoom)


def fact_chars(text: str, fact: Fact) -> tuple[int, int]:
    """Characters of the fact's sentence in the document text ((-1, -1) if not found)."""
    start = text.find(fact.fact.rstrip("."))
    return (start, start + len(fact.fact)) if start >= 0 else (-1, -1)
