"""Ingest benchmark: span-store build vs plain full-KV prefill, and the store's footprint."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from sekv_core.config import StoreSettings
from sekv_core.documents import load_document
from sekv_core.engine import check_window
from sekv_core.ingest import open_or_build, store_path
from sekv_core.methods.full import prefill_cache
from sekv_core.models import LoadedModel
from sekv_core.prompt import encode_context


def bench_ingest(
    loaded: LoadedModel, paths: list[Path], settings: StoreSettings | None = None
) -> list[dict[str, Any]]:
    """Per document: full-KV prefill time, store build wall time (cold: prefill, coding,
    writing and the first load), load time (warm), bytes."""
    settings = settings or StoreSettings()
    rows = []
    for path in paths:
        document = load_document(path)
        context = encode_context(loaded.tokenizer, loaded.template, document.text)
        check_window(loaded, document, context)
        t0 = time.perf_counter()
        prefill_cache(loaded.model, context.ids, settings.prefill_chunk)
        full_s = time.perf_counter() - t0
        cached = store_path(loaded, document, context, settings)
        shutil.rmtree(cached, ignore_errors=True)  # a cold build: prefill, code, write, load
        t0 = time.perf_counter()
        store, _ = open_or_build(loaded, document, context, settings)
        ingest_s = time.perf_counter() - t0
        build = store.manifest["timings"]
        t0 = time.perf_counter()
        open_or_build(loaded, document, context, settings)
        load_s = time.perf_counter() - t0
        b, stats = store.manifest["bytes"], store.manifest["stats"]
        rows.append(
            {
                "document": path.name,
                "tokens": len(context),
                "spans": stats["spans"],
                "anchors_pct": stats["anchors_pct"],
                "span_len_p50": stats["span_len"]["p50"],
                "key_bits": stats["key_bits"],
                "value_bits": stats["value_bits"],
                "resident_share": round(b["resident"] / b["full_kv_fp16"], 4),
                "store_share": round(b["store"] / b["full_kv_fp16"], 4),
                "full_prefill_s": round(full_s, 3),
                "ingest_s": round(ingest_s, 3),
                "ingest_ratio": round(ingest_s / full_s, 3),
                **{k: round(v, 3) for k, v in build.items()},
                "store_load_s": round(load_s, 4),
            }
        )
    return rows
