"""A span store loaded from disk and verified: what answering reads, tier by tier.

A load runs three stages:

1. **verify** — the manifest's digest (no value in it is trusted unchecked), its claims
   against what is asked (format, model, document, settings, the context's length and prompt
   head, positions, sinks), every file's size and sha256, read through the descriptor the
   tensors come from (a store replaced meanwhile fails, it is never read half old, half new);
2. **read** — the three files' tensors, the token ids and sinks checked against the context;
   the offload tier's coding memory-mapped, its blocks decoded as answers first read them
   (:class:`~sekv_core.store.entropy.OffloadTier`); a store without span tokens given the
   codes' and sketch's tables it does not hold, of no effect (:func:`spanless`);
3. **sketch** — the routing sketch's rows: a bounded store's as stored, else rebuilt from the
   decoded span keys (:func:`~sekv_core.store.format.sketch_rows`); then the resident tier
   placed on the model's device.

A build's caller opens the store it wrote as any later load does. A store that fails any check
raises :class:`StoreInvalid` and is never used (it is rebuilt).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import StoreSettings, is_book
from ..kvquant import resident_dtype
from ..prompt import Context
from ..rope import Rope
from ..segment import SINK, n_sinks
from ..sketch import sketch_dtype
from .codes import Code, store_codebooks
from .entropy import OffloadTier
from .format import (
    DIGEST,
    FILES,
    FORMAT,
    FORMAT_VERSION,
    StoreSource,
    device_bytes,
    manifest_digest,
    sha256,
    sketch_rows,
    spanless_tables,
    stored_sketch,
)
from .resident import ResidentTier, SpanTables, file_tables, placed
from .tensorfile import map_tensors, read_tensors


class StoreInvalid(Exception):
    """A store on disk that must not be used (reason in the message)."""


@dataclass
class SpanStore:
    """A loaded, verified span store: its ``manifest``, the ``resident`` tier (the device
    tier and the codes' tables), the ``trace`` (token metadata), the offload ``tier`` and the
    ``codes`` that decode its records (built once: answers and the sketch share them)."""

    path: Path
    manifest: dict[str, Any]
    resident: ResidentTier
    trace: dict[str, torch.Tensor]
    tier: OffloadTier
    codes: dict[str, Code]


def load_store(path: Path, source: StoreSource) -> SpanStore:
    """Load and verify the store at ``path`` as the store of ``source``; raise
    :class:`StoreInvalid` if it must not be used (also when missing or replaced meanwhile)."""
    loaded, context, settings = source.loaded, source.context, source.settings
    try:
        manifest = read_manifest(path)
        check_claims(manifest, source)
        file, offload, trace = (verified_tensors(manifest, path / name) for name in FILES)
    except OSError as exc:  # FileNotFoundError and the like: gone or replaced while read
        raise StoreInvalid(f"unreadable ({exc.strerror or exc}: {exc.filename})") from None
    check_tokens(trace, file, context, manifest["positions"]["sinks"])
    try:
        rows = int((file["span_ends"] - file["span_starts"]).sum())
        file = file if rows else spanless(file, settings)
        tables = file_tables(file)
        codes = store_codebooks(file, settings.key_code, settings.value_code)
        tier = OffloadTier(offload, rows, codes)
        sketch = sketch_of(tables, file.get("sketch"), tier, codes, manifest, source)
        resident = ResidentTier.read(tables, file, sketch)
    except (KeyError, IndexError, RuntimeError, ValueError) as exc:  # tables that do not fit
        raise StoreInvalid(f"the offload tier does not decode ({exc})") from None
    check_sizes(manifest, resident, tier, settings)
    bounded = manifest["positions"]["mode"] == "bounded"
    resident = placed(resident, loaded.device, resident_dtype(loaded.dtype), bounded)
    return SpanStore(path, manifest, resident, trace, tier, codes)


def sketch_of(
    tables: SpanTables,
    stored: torch.Tensor | None,
    tier: OffloadTier,
    codes: dict[str, Code],
    manifest: dict[str, Any],
    source: StoreSource,
) -> torch.Tensor:
    """Stage 3: the routing sketch's rows (module docstring), a ``stored`` sketch checked.
    ValueError where a stored sketch is missing, not expected or of another shape."""
    rows, bits = tier.rows, source.settings.sketch_bits
    if stored_sketch(manifest) and rows:  # (a store without span tokens has no sketch)
        L, H, R = tables.sketch_scale.shape
        shape, dtype = (L, H, rows, R * bits // 8), sketch_dtype(bits)
        if stored is None or stored.dtype != dtype or stored.shape != shape:
            raise ValueError(f"its sketch is not {dtype} rows {tuple(shape)}")
        return stored
    if stored is not None:
        raise ValueError("it holds a sketch its kind of store rebuilds")
    keys = tier.whole(("k",))["k_rows"]
    return sketch_rows(tables, keys, codes["k"], Rope(source.loaded.model), bits)


def spanless(resident: dict[str, torch.Tensor], settings: StoreSettings) -> dict[str, torch.Tensor]:
    """Stage 2's tables of a store without span tokens: with the codes' and sketch's tables it
    does not hold (:func:`~.format.spanless_tables`). ValueError where it holds one."""
    L, H, _, D = resident["fixed_k"].shape
    supplied = spanless_tables(L, H, D, settings)
    held = sorted(name for name in supplied if name in resident)
    if held:
        raise ValueError(f"it has no span tokens but holds {', '.join(held)}")
    return {**resident, **supplied}


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the store at ``path``, its digest verified."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except ValueError as exc:
        raise StoreInvalid(f"manifest unreadable ({exc})") from None
    if not isinstance(manifest, dict):
        raise StoreInvalid("manifest is not a JSON object")
    if manifest.get("version") != FORMAT_VERSION:  # an older sekv's
        raise StoreInvalid(f"version is {manifest.get('version')!r}, expected {FORMAT_VERSION}")
    if manifest.get(DIGEST) != manifest_digest(manifest):
        raise StoreInvalid("manifest digest mismatch (edited or corrupt)")
    return manifest


def check_claims(manifest: dict[str, Any], source: StoreSource) -> None:
    """StoreInvalid unless the manifest describes ``source``: its model, document, context and
    settings."""
    context, settings = source.context, source.settings
    T, start = len(context), context.doc_start
    bounded = is_book(source.loaded.spec.window, T)  # as the streamed build lays it out
    expect = {
        ("format",): FORMAT,
        ("version",): FORMAT_VERSION,
        ("model", "fingerprint"): source.loaded.fingerprint,
        ("document", "sha256"): source.document.sha256,
        ("settings",): json.loads(json.dumps(settings.to_dict())),
        ("document", "context_tokens"): T,
        ("document", "doc_start"): start,
        ("document", "tokens"): T - start,
        ("positions", "mode"): "bounded" if bounded else "original",
        ("positions", "sinks"): n_sinks(T, start, settings.segment),
    }
    for keys, value in expect.items():
        found: Any = manifest
        for k in keys:
            found = found.get(k) if isinstance(found, dict) else None
        if found != value or type(found) is not type(value):
            raise StoreInvalid(f"{'.'.join(keys)} is {found!r}, expected {value!r}")


def verified_tensors(manifest: dict[str, Any], file: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``file`` once it has the size and sha256 the manifest lists, read through
    the descriptor that was checked. The offload file is memory-mapped (its coding stays in the
    file: answers decode the blocks they read; a store replaced meanwhile stays mapped as it
    was verified); the others are read."""
    listed = manifest.get("files")
    meta = listed.get(file.name) if isinstance(listed, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != meta.get("bytes"):
            raise StoreInvalid(f"{file.name} is {size} bytes, expected {meta.get('bytes')}")
        if sha256(f) != meta.get("sha256"):
            raise StoreInvalid(f"{file.name} checksum mismatch (corrupt)")
        try:
            if file.name == "offload.safetensors":
                return map_tensors(f)
            return read_tensors(f)
        except Exception as exc:  # safetensors raises its own error types
            raise StoreInvalid(f"{file.name}: unreadable tensors ({exc})") from None


def check_tokens(
    trace: dict[str, torch.Tensor], resident: dict[str, torch.Tensor], context: Context, sinks: int
) -> None:
    """StoreInvalid unless the stored tokens are the context's and its first ``sinks`` tokens
    are the stored sinks (roles, and the first fixed positions)."""
    try:
        ids, roles, fixed = trace["token_ids"], trace["roles"], resident["fixed_pos"]
    except KeyError as exc:
        raise StoreInvalid(f"tensor {exc} missing") from None
    if not torch.equal(ids, torch.tensor(context.ids, dtype=ids.dtype)):
        raise StoreInvalid("stored token ids differ from the document's")
    stored = int((roles == SINK).sum())
    leading = bool((roles[:sinks] == SINK).all()) and torch.equal(
        fixed[:sinks], torch.arange(sinks)
    )
    if stored != sinks or not leading:
        raise StoreInvalid(f"the store holds {stored} sinks, its manifest says {sinks}")


def check_sizes(
    manifest: dict[str, Any],
    resident: ResidentTier,
    tier: OffloadTier,
    settings: StoreSettings,
) -> None:
    """StoreInvalid unless the manifest's sizes (what ingest and answers report) are those of
    the stored tables, the decoded records and the files."""
    files = {name: manifest["files"][name]["bytes"] for name in FILES}
    expect = {
        "resident": device_bytes(resident, settings.sketch_bits),
        "index": files["resident.safetensors"],
        "offloaded": files["offload.safetensors"],
        "trace": files["trace.safetensors"],
        "offload_records": tier.nbytes,
        "store": sum(files.values()),
    }
    sizes = manifest.get("bytes")
    for name, value in expect.items():
        found = sizes.get(name) if isinstance(sizes, dict) else None
        if found != value:
            raise StoreInvalid(f"bytes.{name} is {found!r}, the store holds {value}")
