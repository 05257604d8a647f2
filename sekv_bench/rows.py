"""Results rows: the memory share every benchmark reports, grouping, and old runs' keys.

A row's ``memory_share`` is the resident-memory target it ran under (a share of the document's
fp16 full KV cache; None for methods whose memory does not follow one); ``resident_share`` and
``store_share`` are the bytes as measured, over the same fp16 full KV cache.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

# keys of results rows written before the names were unified -> today's names
RENAMED = {
    "budget": "memory_share",
    "resident_ratio": "resident_share",
    "store_ratio": "store_share",
}


def resident_share(memory: dict[str, int], digits: int = 5) -> float:
    """An answer's resident memory as a share of the fp16 full KV cache of its document (the
    same whatever dtype the model runs in)."""
    return round(memory["resident_bytes"] / memory["full_kv_bytes"], digits)


def upgrade(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with the keys of older runs renamed to today's (a new row is unchanged)."""
    return {RENAMED.get(k, k): v for k, v in row.items()}


def config_label(method: str, share: float | None) -> str:
    return method if share is None else f"{method}@{share:g}"


def mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(sum(vals) / len(vals), 4) if vals else None


def group(rows: Iterable[dict], *keys: str) -> dict[tuple, list[dict]]:
    """Rows grouped by (method, memory_share, *keys), in first-seen order."""
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        out[(r["method"], r["memory_share"], *(r[k] for k in keys))].append(r)
    return out


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    """Lines of a Markdown table of ``rows`` (dicts with the same keys; the header)."""
    head = list(rows[0])
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(str(row[k]) for k in head) + " |" for row in rows),
    ]
