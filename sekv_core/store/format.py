"""The span store's format: its key, its manifest and digest, the sizes it reports, and what
both builders and the loader share (the routing sketch's rows of decoded keys: a bounded
store's written, the others' rebuilt at each load). Every file, tensor name and dtype, and what
the digest covers: ``docs/store-format.md``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from ..config import StoreSettings
from ..documents import Document, token_pages
from ..kvquant import KV_BITS, STORE_DTYPE, row_bytes
from ..models import LoadedModel, ModelSpec
from ..prompt import Context
from ..rope import Rope
from ..sketch import pack_sketch, span_token_positions
from ..threads import each_on_threads, one_thread
from .codes import Code, fit_code
from .resident import SpanTables

FORMAT = "sekv-span-store"
FORMAT_VERSION = 20
FILES = ("resident.safetensors", "offload.safetensors", "trace.safetensors")
DIGEST = "digest"  # the manifest's own checksum (of every other field)


@dataclass(frozen=True)
class StoreSource:
    """What a span store is of, and what every load checks it against: the ``loaded`` model,
    the ``document``, its ``context`` (the tokens read: the prompt head, then the document's)
    and the store ``settings``."""

    loaded: LoadedModel
    document: Document
    context: Context
    settings: StoreSettings

    @property
    def key(self) -> str:
        """The store's directory name (:func:`store_key`)."""
        return store_key(self.loaded, self.document, self.context, self.settings)


def store_key(loaded: LoadedModel, document: Document, context: Context, settings: Any) -> str:
    """Directory name: hash of document, model fingerprint, prompt tokens, settings (a span
    store's, or a block store's), format."""
    h = hashlib.sha256()
    for part in (
        FORMAT,
        str(FORMAT_VERSION),
        document.sha256,
        loaded.fingerprint,
        json.dumps(settings.to_dict(), sort_keys=True),
    ):
        h.update(part.encode() + b"\0")
    h.update(np.asarray(context.ids, dtype=np.int64).tobytes())
    return f"{document.sha256[:12]}-{h.hexdigest()[:20]}"


def device_bytes(tables: SpanTables, sketch_bits: int) -> int:
    """Bytes of the device tier as an answer holds it: sinks' and anchors' K and V as 8-bit
    rows, the sketch's rows (``sketch_bits`` per number) and its directions, mean and scales
    at 2 bytes per number (a store without span tokens has no sketch), each span's length and
    representatives and each span token's span (int64)."""
    L, H, F, D = tables.fixed_k.shape
    spans = int(tables.span_starts.numel())
    span_tokens = tables.span_tokens
    out = 2 * L * H * F * row_bytes(D, KV_BITS) + 8 * (spans + span_tokens)
    if span_tokens:
        R = tables.sketch_proj.shape[-1]
        out += L * H * span_tokens * R * sketch_bits // 8
        directions = (tables.sketch_proj, tables.sketch_mean, tables.sketch_scale)
        out += 2 * sum(t.numel() for t in directions)
    return out + tables.span_reps.numel() * 8


def spans_pay(spec: ModelSpec, settings: StoreSettings, span_tokens: int) -> bool:
    """Whether a context's ``span_tokens`` are worth coding into the offload tier: their K and
    V as 8-bit resident rows would take more bytes than the tables of the codes and the sketch
    that coding needs (:func:`spanless_tables`: their bytes are the same at any length)."""
    L, H, D = spec.num_layers, spec.num_kv_heads, spec.head_dim
    rows = L * H * span_tokens * 2 * row_bytes(D, KV_BITS)
    return rows > nbytes(spanless_tables(1, 1, D, settings)) * L * H


def spanless_tables(L: int, H: int, D: int, settings: StoreSettings) -> dict[str, torch.Tensor]:
    """The tables a store without span tokens does not hold, as answers read them (L layers, H
    KV heads, D head dim): its codes fitted to no rows, and a sketch of zero directions (unit
    scales) — nothing is decoded or routed with them."""
    R = min(settings.sketch_dim, D)
    empty = torch.zeros(L, H, 0, D)
    return {
        **fit_code(empty, settings.key_code).tensors("k"),
        **fit_code(empty, settings.value_code).tensors("v"),
        "sketch_proj": torch.zeros(L, H, D, R, dtype=STORE_DTYPE),
        "sketch_key": torch.zeros(L, H, D, R, dtype=STORE_DTYPE),
        "sketch_mean": torch.zeros(L, H, D, dtype=STORE_DTYPE),
        "sketch_scale": torch.ones(L, H, R, dtype=STORE_DTYPE),
    }


def store_manifest(source: StoreSource, positions: dict[str, Any]) -> dict[str, Any]:
    """The manifest's fixed part (``bytes``, ``stats``, ``files`` and ``digest`` are filled
    when the store is written)."""
    loaded, document, context = source.loaded, source.document, source.context
    spec = loaded.spec
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": {"id": loaded.model_id, "fingerprint": loaded.fingerprint, "spec": asdict(spec)},
        "tokenizer": {
            "class": type(loaded.tokenizer).__name__,
            "vocab_size": len(loaded.tokenizer),
        },
        "settings": source.settings.to_dict(),
        "document": {
            "path": os.path.abspath(document.path),  # `sekv stores rm FILE` matches it
            "sha256": document.sha256,
            "tokens": len(context) - context.doc_start,
            "pages": document.pages,
            "context_tokens": len(context),
            "doc_start": context.doc_start,
        },
        "positions": positions,
        "bytes": {
            "full_kv_fp16": spec.kv_bytes(len(context), 2),
            "full_kv_fp32": spec.kv_bytes(len(context), 4),
        },
    }


def trace_tensors(
    document: Document, context: Context, surprisal: np.ndarray, roles: np.ndarray
) -> dict[str, torch.Tensor]:
    """Token metadata for explanations: ids, surprisal, roles, pages, character offsets."""
    doc_offsets = np.full((len(context), 2), -1, dtype=np.int32)
    doc_offsets[context.doc_start :] = np.asarray(context.offsets, dtype=np.int32).reshape(-1, 2)
    pages = np.ones(len(context), dtype=np.int32)
    pages[context.doc_start :] = token_pages(document, context.offsets)
    return {
        "token_ids": torch.tensor(context.ids, dtype=torch.int64),
        "surprisal": torch.from_numpy(np.asarray(surprisal, dtype=np.float32)),
        "roles": torch.from_numpy(np.asarray(roles, dtype=np.int8)),
        "pages": torch.from_numpy(pages),
        "offsets": torch.from_numpy(doc_offsets),
    }


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The sha256 of the canonical manifest (sorted-keys compact JSON of every field but
    :data:`DIGEST`): it covers the files' checksums and sizes, positions, document, bytes."""
    body = {k: v for k, v in manifest.items() if k != DIGEST}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of the tensors' data."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def sha256(source: Path | BinaryIO) -> str:
    """Hex sha256 of a file (a path, or an open binary file read from its start)."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            return sha256(f)
    source.seek(0)
    h = hashlib.sha256()
    for block in iter(lambda: source.read(1 << 22), b""):
        h.update(block)
    return h.hexdigest()


def stored_sketch(manifest: dict[str, Any]) -> bool:
    """Whether the store holds its sketch's rows: a bounded store's (a book's: rebuilding them
    would decode every key at each load); a store within the model's window rebuilds them."""
    return manifest["positions"]["mode"] == "bounded"


def sketch_rows(
    tables: SpanTables,
    k_rows: torch.Tensor,
    code: Code,
    rope: Rope | None,
    bits: int,
) -> torch.Tensor:
    """The routing sketch's packed rows (L, H, S, R / 2 or R) of the decoded span keys:
    each key (rotated to its position unless ``rope`` is None: a bounded store's sketch is of
    pre-RoPE keys) projected, ``(k - mu) B / scale``, rounded and clamped to the sketch's
    levels (``bits``: 4 or 8). On one thread, so every load of a store routes with the same
    rows."""
    scale = tables.sketch_scale.float()  # (L, H, R)
    R = scale.shape[-1]
    proj = tables.sketch_key.float() / scale[:, :, None]  # (L, H, D, R), in levels
    offset = tables.sketch_mean.float()[:, :, None] @ proj  # (L, H, 1, R)
    L, H = proj.shape[:2]
    positions = span_token_positions(tables.span_starts, tables.span_ends)
    S = positions.numel()
    top = 2 ** (bits - 1) - 1
    if not S:  # a document of a few tokens: no spans
        return pack_sketch(torch.zeros(L, H, 0, R), bits)
    rows: list[torch.Tensor | None] = [None] * L  # each layer's packed rows (H, S, R / 2 or R)
    B = code.record_bytes
    records = k_rows.view(L, H * S, B)

    def layer_rows(layer: int) -> None:  # one layer at a time: bounded working memory
        if rope is None:  # pre-RoPE keys: the projection folds into the code's synthesis
            then = (proj[layer], -offset[layer][:, 0])
            raw = code.decode(records[layer], layer, [S] * H, torch.float32, then).view(H, S, -1)
        else:
            keys = code.decode(records[layer], layer, [S] * H, torch.float32)
            keys = rope.rotate(keys, positions.repeat(H))
            raw = torch.baddbmm(offset[layer], keys.view(H, S, -1), proj[layer], beta=-1)
        rows[layer] = pack_sketch(raw.round_().clamp_(-top, top), bits)

    threads = torch.get_num_threads()
    with one_thread():  # each layer on one intra-op thread: the same rows however many run
        each_on_threads(layer_rows, range(L), workers=threads)
    return torch.stack(rows)  # type: ignore[arg-type]  # every layer filled
