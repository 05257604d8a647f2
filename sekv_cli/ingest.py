"""`sekv ingest`: build (or find) the span store of a document, or of each of a collection's."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from sekv_core.collection import is_collection, select_documents
from sekv_core.config import MethodSettings
from sekv_core.errors import SekvError
from sekv_core.paths import STORES_ENV, check_home
from sekv_core.threads import resolve_threads

from . import loading
from .errors import handle_errors, warn
from .loading import library_progress, open_library, open_store
from .options import (
    JSON_OPTION,
    MAX_TOKENS_OPTION,
    MODEL_OPTION,
    PATHS_ARGUMENT,
    THREADS_OPTION,
)
from .output import print_json
from .progress import reading_notice
from .terminal import console, err, one_line
from .words import how_many, human_bytes

CLUSTER_OPTION = typer.Option(
    None,
    "--cluster",
    metavar="ADDRESS",
    help="Read the documents on a Ray cluster: `local` starts one on this machine, an address "
    "(as `ray start --head` prints it) joins a running one. Each task reads one document with "
    "--threads threads (default 1). Needs: pip install 'sekv[cluster]'.",
)
STORES_OPTION = typer.Option(
    None,
    "--stores",
    metavar="DIR",
    help=f"Keep the span stores in DIR (default ${STORES_ENV}, else $SEKV_HOME/stores); with "
    "--cluster a folder every node mounts at this path. Later commands find them with "
    f"{STORES_ENV}=DIR.",
)


@handle_errors
def ingest(
    paths: list[Path] = PATHS_ARGUMENT,
    model: str | None = MODEL_OPTION,
    json_out: bool = JSON_OPTION,
    max_tokens: int = MAX_TOKENS_OPTION,
    threads: int | None = THREADS_OPTION,
    cluster: str | None = CLUSTER_OPTION,
    stores: Path | None = STORES_OPTION,
) -> None:
    """Read each document at PATH... once and save its SeKV span store; later questions start
    from it (an unchanged document's store is found, not read again)."""
    with stores_in(stores):
        if cluster is not None:
            ingest_on_cluster(paths, cluster, model, json_out, max_tokens, threads)
        else:
            ingest_here(paths, model, json_out, max_tokens, threads)


@contextmanager
def stores_in(folder: Path | None) -> Iterator[None]:
    """``$SEKV_STORES`` set to ``folder`` (absolute) for the block, as it was after it."""
    if folder is None:
        yield
        return
    before = os.environ.get(STORES_ENV)
    os.environ[STORES_ENV] = str(folder.expanduser().absolute())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(STORES_ENV, None)
        else:
            os.environ[STORES_ENV] = before


def ingest_here(
    paths: list[Path], model: str | None, json_out: bool, max_tokens: int, threads: int | None
) -> None:
    """A local ingest: one document's store, or a collection's (:func:`ingest_collection`)."""
    n_threads = resolve_threads(threads)
    if is_collection(paths):
        ingest_collection(paths, model, json_out, max_tokens, n_threads)
        return
    _, document, context, store, hit, seconds = open_store(paths[0], model, n_threads, max_tokens)
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
        ("document", one_line(document.path)),
        ("store", f"{one_line(store.path)} ({'cache hit' if hit else 'built'})"),
        (
            "tokens",
            f"{len(context):,} ({m['document']['tokens']:,} document, "
            f"{how_many(document.pages, 'page')})",
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
    console().print(table)


def ingest_collection(
    paths: list[Path], model: str | None, json_out: bool, max_tokens: int, threads: int
) -> None:
    """Every document's store found or built (progress over them all on stderr); one row
    each, or with --json: ``documents[]``, ``skipped[]`` and the memory ``in_all``."""
    start = time.perf_counter()
    settings = MethodSettings(warn=warn)
    library, _ = open_library(
        paths, model, "sekv", settings, threads, max_tokens=max_tokens, verb="Ingesting",
        build_all=True,
    )  # fmt: skip
    rows = library.documents()
    data = {
        "documents": rows,
        "skipped": [s.to_json() for s in library.skipped],
        "model": library.loaded.model_id,
        "in_all": library.memory(),
        "timings": {"total_s": round(time.perf_counter() - start, 4), "threads": threads},
    }
    if json_out:
        print_json(data)
        return
    table = Table(box=None)
    for column in ("document", "tokens", "pages", "store", "resident", "on disk"):
        table.add_column(column, justify="left" if column in ("document", "store") else "right")
    for row in rows:
        store, mem = row["store"], row["memory"]
        table.add_row(
            Text(one_line(row["path"])),  # paths are text, not markup
            f"{row['tokens']:,}",
            str(row["pages"]),
            "cache hit" if store["cache_hit"] else "built",
            human_bytes(mem["resident_bytes"]),
            human_bytes(mem["store_bytes"]),
        )
    console().print(table)
    in_all = data["in_all"]
    console().print(
        Text(
            f"{how_many(in_all['documents'], 'document')}, {how_many(in_all['tokens'], 'token')}: "
            "resident "
            f"{human_bytes(in_all['resident_all_bytes'])} if every store were held at once "
            f"(an answer holds the stores it is routed to), full KV "
            f"{human_bytes(in_all['full_kv_bytes'])}; {data['timings']['total_s']:.1f} s"
        )
    )


def ingest_on_cluster(
    paths: list[Path],
    address: str,
    model: str | None,
    json_out: bool,
    max_tokens: int,
    threads: int | None,
) -> None:
    """Every document's store found or built on the Ray cluster at ``address`` (progress over
    the cluster on stderr); one row each with the node that read it, or with --json:
    ``documents[]`` (node, seconds, tokens), ``skipped[]``, ``in_all`` and ``cluster``."""
    from sekv_core import cluster  # torch and Ray: only for a cluster ingest

    cluster.require_ray()  # before anything is read
    if any(str(p) == "" for p in paths):
        raise SekvError("the document path is empty; name a file or a folder (. for this one)")
    start = time.perf_counter()
    with reading_notice(paths):
        selection = select_documents(paths, max_tokens, warn)
    check_home()
    per_task = threads if threads is not None else 1
    loaded = loading.load_model_quietly(model, resolve_threads(threads))
    with library_progress("Ingesting") as progress:
        result = cluster.ingest_on_cluster(
            address, loaded, model, selection, None, per_task, max_tokens, progress, warn
        )
    rows = [d.to_json() for d in result.documents]
    built = [r for r in rows if not r["store"]["cache_hit"]]
    line = f"{how_many(len(rows), 'document')}: {len(built)} read on the cluster"
    if result.nodes:
        line += (
            f" ({how_many(result.nodes, 'node')}, {how_many(result.slots, 'task')} at once, "
            f"{how_many(per_task, 'thread')} each; {result.tokens_per_s:,.0f} tokens/s in all)"
        )
    line += f", {len(rows) - len(built)} found"
    if result.skipped:
        line += f"; {len(result.skipped)} skipped (see above)"
    err.print(Text(line), soft_wrap=True)
    data = {
        "documents": rows,
        "skipped": [s.to_json() for s in result.skipped],
        "model": loaded.model_id,
        "in_all": result.in_all(),
        "cluster": {
            "address": address,
            "nodes": result.nodes,
            "slots": result.slots,
            "threads": per_task,
            "tokens_read": result.tokens_read,
            "read_s": round(result.read_s, 4),
            "tokens_per_s": round(result.tokens_per_s, 1),
        },
        "timings": {"total_s": round(time.perf_counter() - start, 4)},
    }
    if json_out:
        print_json(data)
        return
    table = Table(box=None)
    for column in ("document", "tokens", "store", "node", "seconds", "on disk"):
        table.add_column(column, justify="left" if column in ("document", "node") else "right")
    for row in rows:
        hit = row["store"]["cache_hit"]
        table.add_row(
            Text(one_line(row["path"])),  # paths are text, not markup
            f"{row['tokens']:,}",
            "cache hit" if hit else "built",
            Text(row["host"] or "–"),
            "–" if row["seconds"] is None else f"{row['seconds']:.1f}",
            human_bytes(row["memory"]["store_bytes"]),
        )
    console().print(table)
