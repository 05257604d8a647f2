"""`sekv ingest`: build (or find) a document's span store."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from sekv_core.threads import resolve_threads

from .common import (
    JSON_OPTION,
    MAX_TOKENS_OPTION,
    MODEL_OPTION,
    THREADS_OPTION,
    handle_errors,
    open_store,
    print_json,
)
from .words import human_bytes


@handle_errors
def ingest(
    file: Path = typer.Argument(..., help="Document to ingest: .pdf, .txt or .md."),
    model: str | None = MODEL_OPTION,
    json_out: bool = JSON_OPTION,
    max_tokens: int = MAX_TOKENS_OPTION,
    threads: int | None = THREADS_OPTION,
) -> None:
    """Read FILE once and save its SeKV span store; later questions start from it."""
    n_threads = resolve_threads(threads)
    _, document, context, store, hit, seconds = open_store(file, model, n_threads, max_tokens)
    m = store.manifest
    b, stats = m["bytes"], m["stats"]
    full = b["full_kv_fp16"]
    data = {
        "store": {"path": str(store.path), "cache_hit": hit},
        "document": {
            "path": str(document.path),
            "sha256": document.sha256,
            "tokens": m["document"]["tokens"],
            "pages": document.pages,
        },
        "model": m["model"]["id"],
        "tokens": len(context),
        "spans": stats["spans"],
        "anchors": stats["anchors"],
        "sinks": stats["sinks"],
        "stats": stats,
        "memory": {
            "resident_bytes": b["resident"],
            "offloaded_bytes": b["offloaded"],
            "full_kv_bytes": full,
            "resident_share": round(b["resident"] / full, 4),
            "offloaded_share": round(b["offloaded"] / full, 4),
            # the offload tier as answers read it: its fixed-rate records, decoded in host memory
            "offload_records_bytes": b["offload_records"],
            "offload_records_share": round(b["offload_records"] / full, 4),
            "store_bytes": b["store"],
            "store_share": round(b["store"] / full, 4),
        },
        "timings": {
            "total_s": round(seconds, 4),
            **({} if hit else m["timings"]),
            "threads": n_threads,
        },
        "positions": m["positions"]["mode"],
    }
    if "stream" in m:  # a book: read in chunks with bounded positions
        data["stream"] = m["stream"]
    if json_out:
        print_json(data)
        return
    table = Table(show_header=False, box=None)
    mem = data["memory"]
    rows = [
        ("document", str(document.path)),
        ("store", f"{store.path} ({'cache hit' if hit else 'built'})"),
        (
            "tokens",
            f"{len(context):,} ({m['document']['tokens']:,} document, {document.pages} pages)",
        ),
        (
            "spans",
            f"{stats['spans']} (length p50 {stats['span_len']['p50']:g}, "
            f"{stats['span_len']['min']}–{stats['span_len']['max']})",
        ),
        ("anchors", f"{stats['anchors']} ({stats['anchors_pct']}%), sinks {stats['sinks']}"),
        ("resident", f"{human_bytes(b['resident'])} ({mem['resident_share']:.1%} of fp16 full KV)"),
        (
            "offloaded",
            f"{human_bytes(b['offloaded'])} ({mem['offloaded_share']:.1%} of fp16 full KV); "
            f"{human_bytes(b['offload_records'])} as answers read it "
            f"({mem['offload_records_share']:.1%})",
        ),
        ("on disk", f"{human_bytes(b['store'])} ({mem['store_share']:.1%} of fp16 full KV)"),
        ("full KV", f"{human_bytes(full)} fp16, {human_bytes(b['full_kv_fp32'])} fp32"),
        ("time", f"{seconds:.2f} s"),
    ]
    if "stream" in m:
        st = m["stream"]
        speed = ", ".join(f"{k} {v:,.0f}" for k, v in st["tokens_per_s_at"].items())
        rows.insert(
            -1,
            (
                "streamed",
                f"chunks of {st['chunk']}, window {st['window']:,}, zoom budget {st['budget']}, "
                f"{st['positions']} positions (max {st['max_position']:,}); "
                f"tokens/s at {speed or '–'}",
            ),
        )
    for k, v in rows:
        table.add_row(Text(k, style="bold"), Text(v))  # paths are text, not markup
    Console().print(table)
