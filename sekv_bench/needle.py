"""Needle-in-a-haystack grid: SeKV vs full KV, measured side by side in one run.

For each haystack length and needle depth: both methods answer the needle question (beyond the
model window, a book, SeKV alone: full KV cannot read it); reported per
cell are correctness, SeKV's resident share (bytes incl. zoom peak / fp16 full-KV bytes), routing
recall vs the oracle router at the same zoom budget, time to first token on a *repeat* question
(store loaded from disk vs full-KV re-prefill), and decode speed.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from sekv_core.config import MethodSettings, exceeds_window
from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.models import LoadedModel

from .diagnostics import ask_probed, attach_probe
from .haystack import NEEDLES, haystack
from .rows import resident_share

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def bench_needle(
    loaded: LoadedModel,
    lengths: list[int],
    depths: tuple[float, ...] = DEPTHS,
    budget: int = 128,
    needle: int = 2,
    recall: bool = True,
    max_new_tokens: int = 24,
    progress: Callable[[dict[str, Any]], None] | None = None,
    settings: MethodSettings | None = None,
) -> list[dict[str, Any]]:
    """One row per (length, depth): both methods answer the needle question. SeKV runs from
    ``settings`` with a zoom ``budget`` (tokens per layer and KV head); ``recall``: its routing
    is held against the oracle router (:mod:`.diagnostics`)."""
    nd = NEEDLES[needle]
    settings = replace(settings or MethodSettings(), budget=budget)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in lengths:
            for depth in depths:
                path = Path(tmp) / f"haystack-{n}-{int(depth * 100)}.txt"
                path.write_text(haystack(loaded.tokenizer, n, depth, nd, seed=n))
                doc = load_document(path)
                built = Session(loaded, doc, "sekv", settings)  # ingest: builds the store once
                # full KV reads what fits the window; a book is SeKV's alone
                fits = not exceeds_window(loaded.spec.window, len(built.context))
                full = None
                if fits:
                    full = Session(loaded, doc, "full").ask(nd.question, max_new_tokens)
                t0 = time.perf_counter()  # a repeat question: the store is loaded from disk
                session = Session(loaded, doc, "sekv", settings)
                probe = attach_probe(session) if recall else None
                sekv = ask_probed(session, nd.question, max_new_tokens, probe)
                sekv_ttft = (
                    time.perf_counter()
                    - t0
                    - sekv.timings["answer_s"]
                    + (sekv.timings["first_token_s"] - sekv.timings["prepare_s"])
                )
                needle_zoomed = any(nd.answer in z["preview"] for z in sekv.zoom[:10])
                rows.append(
                    {
                        "tokens": sekv.document["tokens"],
                        "depth": depth,
                        "full_ok": nd.answer in full.answer if full else None,
                        "sekv_ok": nd.answer in sekv.answer,
                        "needle_in_top10_zoom": needle_zoomed,
                        "resident_share": resident_share(sekv.memory, 4),
                        "recall_vs_oracle": sekv.routing.get("recall_vs_oracle"),
                        "mass_captured": sekv.routing.get("mass_captured"),
                        "ttft_full_s": full.timings["first_token_s"] if full else None,
                        "ttft_sekv_s": round(sekv_ttft, 4),
                        "ttft_ratio": (
                            round(sekv_ttft / full.timings["first_token_s"], 4) if full else None
                        ),
                        "decode_tps_full": full.timings["decode_tokens_per_s"] if full else None,
                        "decode_tps_sekv": sekv.timings["decode_tokens_per_s"],
                        "sekv_answer": sekv.answer[:80],
                    }
                )
                if progress:
                    progress(rows[-1])
    return rows


def summarize_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def mean(key: str) -> float:
        vals = [r[key] for r in rows if r[key] is not None]
        return round(sum(vals) / len(vals), 4) if vals else float("nan")

    compared = [r for r in rows if r["full_ok"] is not None]  # books: SeKV alone
    longest = max((r["tokens"] for r in compared), default=0)
    at_longest = [r for r in compared if r["tokens"] == longest]
    full_tps = sum(r["decode_tps_full"] for r in at_longest)
    return {
        "cells": len(rows),
        "full_accuracy": mean("full_ok"),
        "sekv_accuracy": mean("sekv_ok"),
        "resident_share_mean": mean("resident_share"),
        "recall_vs_oracle_mean": mean("recall_vs_oracle"),
        "mass_captured_mean": mean("mass_captured"),
        "ttft_ratio_mean": mean("ttft_ratio"),
        "decode_speed_ratio_at_longest": (
            round(sum(r["decode_tps_sekv"] for r in at_longest) / full_tps, 4)
            if full_tps > 0
            else None
        ),
    }
