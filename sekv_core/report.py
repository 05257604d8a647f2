"""What a span store holds, as plain data: the segmentation and bytes of every span.

:func:`build_report` turns a loaded :class:`~sekv_core.store.load.SpanStore` into one JSON-able
dict that ``sekv inspect`` prints (``--json``) or renders (the terminal view, the HTML page).
Nothing here renders.

Token texts tile the document: each document token's text runs from the end of the previous
token to its own end (the whitespace between tokens goes to the following token), so joining the
texts of the document tokens gives back ``document.text`` exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .documents import Document
from .segment import ANCHOR, SINK
from .store.load import SpanStore

ROLE_NAMES = {SINK: "sink", ANCHOR: "anchor", 2: "span"}
PREVIEW_CHARS = 60


def build_report(store: SpanStore, document: Document, tokenizer: Any) -> dict[str, Any]:
    """The store's segmentation, per-span bytes, and per-token surprisal.

    Returns
    -------
    dict with keys ``document``, ``model``, ``store``, ``bytes`` (the manifest's per-tier bytes),
    ``ratios`` (resident / offloaded / whole-store bytes over the fp16 full KV), ``stats``
    (segmentation and the offload code's bits per number), ``settings``, ``surprisal``
    (distribution of document tokens), ``spans`` (one dict per span) and ``tokens`` (one dict
    per context token, prompt head included).
    """
    manifest = store.manifest
    trace = {k: v.cpu().numpy() for k, v in store.trace.items()}
    surprisal = trace["surprisal"].astype(np.float64)  # (T,)
    roles, pages = trace["roles"], trace["pages"]  # (T,), (T,)
    doc_start = int(manifest["document"]["doc_start"])
    texts = token_texts(document.text, trace["offsets"], trace["token_ids"], doc_start, tokenizer)

    starts = store.resident.span_starts.cpu().numpy().astype(np.int64)  # (N,)
    ends = store.resident.span_ends.cpu().numpy().astype(np.int64)  # (N,)
    span_of = span_index(starts, ends, len(roles))  # (T,)
    spans = _span_rows(store, document, trace["offsets"], pages, starts, ends)

    full = manifest["bytes"]["full_kv_fp16"] or 1
    doc_h = surprisal[doc_start:]
    return {
        "document": {
            "path": str(document.path),
            "name": document.path.name,
            "sha256": document.sha256,
            "kind": document.kind,
            "pages": document.pages,
            "chars": len(document.text),
            "tokens": manifest["document"]["tokens"],
            "context_tokens": manifest["document"]["context_tokens"],
            "doc_start": doc_start,
        },
        "model": manifest["model"]["id"],
        "model_spec": manifest["model"]["spec"],
        "store": {"path": str(store.path), "created": manifest.get("created")},
        "bytes": dict(manifest["bytes"]),
        "ratios": {
            "resident": round(manifest["bytes"]["resident"] / full, 4),
            "offloaded": round(manifest["bytes"]["offloaded"] / full, 4),
            "store": round(manifest["bytes"]["store"] / full, 4),
        },
        "stats": manifest["stats"],
        "settings": manifest["settings"],
        "surprisal": {
            "mean": round(float(doc_h.mean()), 3) if len(doc_h) else 0.0,
            "p50": round(float(np.median(doc_h)), 3) if len(doc_h) else 0.0,
            "p99": round(float(np.percentile(doc_h, 99)), 3) if len(doc_h) else 0.0,
            "max": round(float(doc_h.max()), 3) if len(doc_h) else 0.0,
            "threshold": manifest["stats"]["threshold_nats"],
        },
        "spans": spans,
        "tokens": [
            {
                "text": text,
                "surprisal": round(h, 3),
                "role": ROLE_NAMES[role],
                "span": span if span >= 0 else None,
                "page": page,
            }
            for text, h, role, span, page in zip(
                texts,
                surprisal.tolist(),
                roles.tolist(),
                span_of.tolist(),
                pages.tolist(),
                strict=True,
            )
        ],
    }


def token_texts(
    text: str, offsets: np.ndarray, token_ids: np.ndarray, doc_start: int, tokenizer: Any
) -> list[str]:
    """Display text of every context token.

    Prompt-head tokens (before ``doc_start``) are decoded one by one. Document tokens cut the
    document at the running maximum of their end offsets (robust to tokens that share a
    character, e.g. pieces of one multi-byte character); the last one runs to the end of the text.
    """
    head = [tokenizer.decode([int(i)]) for i in token_ids[:doc_start].tolist()]
    doc_ends = offsets[doc_start:, 1].astype(np.int64)  # (T_doc,)
    if not len(doc_ends):
        return head
    cuts = np.maximum.accumulate(np.clip(doc_ends, 0, len(text)))  # (T_doc,) non-decreasing
    cuts[-1] = len(text)
    bounds = np.concatenate([[0], cuts]).tolist()
    return head + [text[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def span_index(starts: np.ndarray, ends: np.ndarray, total: int) -> np.ndarray:
    """(T,) span id of each token, -1 for tokens outside every span (sinks, anchors)."""
    lengths = ends - starts  # (N,)
    out = np.full(total, -1, dtype=np.int64)
    ids = np.repeat(np.arange(len(starts)), lengths)  # (sum |S|,)
    first = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)  # span start - its offset
    out[np.arange(len(ids)) + first] = ids
    return out


def span_bytes(store: SpanStore) -> np.ndarray:
    """Offloaded bytes of each span (N,): its tokens' key and value records in every layer and
    KV head."""
    res, spec = store.resident, store.manifest["model"]["spec"]
    lengths = (res.span_ends - res.span_starts).cpu().numpy().astype(np.int64)  # (N,)
    record = sum(code.record_bytes for code in store.codes.values())
    return lengths * int(spec["num_layers"]) * int(spec["num_kv_heads"]) * record


def _span_rows(
    store: SpanStore,
    document: Document,
    offsets: np.ndarray,
    pages: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
) -> list[dict[str, Any]]:
    if not len(starts):
        return []
    sizes = span_bytes(store)
    char_start = offsets[starts, 0].clip(min=0)  # (N,)
    char_end = offsets[ends - 1, 1].clip(min=0)  # (N,)
    return [
        {
            "id": i,
            "start": s,
            "end": e,
            "length": e - s,
            "page": page,
            "offloaded_bytes": nbytes,
            "preview": preview(document.text[cs:ce]),
        }
        for i, (s, e, page, nbytes, cs, ce) in enumerate(
            zip(
                starts.tolist(),
                ends.tolist(),
                pages[starts].tolist(),
                sizes.tolist(),
                char_start.tolist(),
                char_end.tolist(),
                strict=True,
            )
        )
    ]


def preview(text: str, limit: int = PREVIEW_CHARS) -> str:
    """One line: whitespace collapsed, cut at ``limit`` characters with an ellipsis."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"
