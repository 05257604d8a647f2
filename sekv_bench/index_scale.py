"""The collection index alone, at scale: build, size, opening and ranking as a folder grows.

:func:`bench_index` writes ``documents`` generated reports (:func:`sekv_bench.folder.
write_collection`, facts planted in some) and, for each size in ``sizes`` (the first that many
reports), builds a fresh index of them (:class:`sekv_core.index.catalog.Catalog`), then
measures in the same run: build seconds and tokens per second, bytes on disk and per 1K
tokens, opening the indexed folder again (walk, stat, nothing read), the first question's
ranking (the passages loaded) and each later question's, the planted facts' documents ranked
first (exact words / paraphrased), and the process's peak RSS so far. No language model runs:
the tokenizer only counts tokens.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sekv_core.collection import document_files
from sekv_core.index.catalog import Catalog
from sekv_core.index.embedder import load_embedder
from sekv_core.index.ranking import Finder

from .book import peak_rss_bytes
from .folder import write_collection


def bench_index(
    tokenizer: Any,
    out: Path,
    documents: int = 1000,
    tokens: int = 1_000_000,
    sizes: Sequence[int] = (100, 300, 1000),
    facts: int = 12,
    on_size: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per size (see the module's docstring); rows go to ``out/results.jsonl``, a
    table to ``out/results.md``."""
    folder = out / "collection"
    planted = write_collection(tokenizer, folder, documents, tokens, facts)
    files = document_files([folder]).files
    counts = {
        f: len(tokenizer(f.read_text(), add_special_tokens=False)["input_ids"]) for f in files
    }
    embedder = load_embedder()
    rows = []
    for size in sorted(s for s in sizes if s <= len(files)):
        chosen = files[:size]
        index = out / f"index-{size}.sqlite"
        for leftover in out.glob(f"index-{size}.sqlite*"):
            leftover.unlink()
        start = time.perf_counter()
        with Catalog(index) as catalog:
            catalog.sync(chosen, embedder=lambda: embedder)
        build_s = time.perf_counter() - start

        start = time.perf_counter()  # a later run: walk, stat, nothing read
        again_files = document_files([folder]).files
        catalog = Catalog(index)
        synced = catalog.sync(again_files[:size])
        open_s = time.perf_counter() - start

        start = time.perf_counter()
        finder = Finder(catalog, synced.files, embedder)
        load_s = time.perf_counter() - start
        where = {f: i for i, f in enumerate(chosen)}
        right = {"exact": 0, "paraphrased": 0}
        asked, times = 0, []
        for p in planted:
            if p.path not in where or where[p.path] >= size:
                continue
            asked += 1
            for kind, question in (("exact", p.fact.question), ("paraphrased", p.fact.paraphrase)):
                start = time.perf_counter()
                ranked = finder.rank(question)
                times.append(time.perf_counter() - start)
                right[kind] += ranked[0].index == where[p.path]
        held = catalog.counts()
        catalog.close()
        n_tokens = sum(counts[f] for f in chosen)
        row = {
            "documents": size,
            "tokens": n_tokens,
            "passages": held["passages"],
            "build_s": round(build_s, 1),
            "build_tokens_per_s": round(n_tokens / build_s),
            "bytes": held["bytes"],
            "bytes_per_1k_tokens": round(1000 * held["bytes"] / n_tokens),
            "open_s": round(open_s, 3),
            "first_rank_load_s": round(load_s, 3),
            "rank_s_median": round(statistics.median(times), 4) if times else None,
            "rank_s_max": round(max(times), 4) if times else None,
            "questions": asked,
            "exact_first": right["exact"],
            "paraphrased_first": right["paraphrased"],
            "peak_rss_bytes": peak_rss_bytes(),
        }
        rows.append(row)
        if on_size:
            on_size(row)
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "results.md").write_text(markdown(rows))
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """One row per size."""
    head = (
        "| documents | tokens | passages | build | tokens/s | on disk | per 1K tokens | open | "
        "first question (load + rank) | rank, median / max | ranked first (exact / para.) "
        "| peak RSS |"
    )
    lines = [
        "# The collection index alone",
        "",
        head,
        "|" + "---|" * 12,
    ]
    for r in rows:
        lines.append(
            f"| {r['documents']:,} | {r['tokens']:,} | {r['passages']:,} | {r['build_s']} s | "
            f"{r['build_tokens_per_s']:,} | {r['bytes'] / 2**20:.1f} MiB | "
            f"{r['bytes_per_1k_tokens'] / 1024:.1f} KiB | {r['open_s']} s | "
            f"{r['first_rank_load_s']} s | {r['rank_s_median']} / {r['rank_s_max']} s | "
            f"{r['exact_first']} / {r['paraphrased_first']} of {r['questions']} | "
            f"{r['peak_rss_bytes'] / 2**20:,.0f} MiB |"
        )
    return "\n".join(lines) + "\n"
