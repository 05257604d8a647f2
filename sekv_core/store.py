"""A span store loaded from disk and verified: what answering reads, tier by tier.

Loading checks the manifest's digest (:func:`sekv_core.format.manifest_digest`: no value in it
is trusted unchecked), then what it claims against what is asked: format, model, document,
settings, the context's length and prompt head, the positions' mode (bounded exactly when the
context exceeds the model window) and sinks; then every file's size and checksum, read through
the descriptor the tensors are loaded from (a store replaced meanwhile fails the check, it is
never read half old, half new); then the stored sinks and token ids against the context; then
the routing sketch's rows are rebuilt from the verified keys (:mod:`sekv_core.sketch_rebuild`).
A store that fails raises :class:`StoreInvalid` and is never used
(:func:`sekv_core.ingest.open_or_build` rebuilds it). The resident tier is read whole; the
offload tier is memory-mapped and sliced per zoom.
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_bytes

from .codec import store_codebooks
from .config import StoreSettings, exceeds_window
from .constrained import unconstrain
from .documents import Document
from .format import (
    DIGEST,
    FILES,
    FORMAT,
    FORMAT_VERSION,
    manifest_digest,
    map_safetensors,
    nbytes,
    sha256,
    tier_bytes,
)
from .models import LoadedModel
from .narrow import widen
from .packed import unpack
from .prompt import Context
from .rans import expanded
from .reconstruct import RecordRanges
from .rope import Rope
from .segment import SINK, n_sinks
from .sinks import restore_sinks
from .sketch import column_major
from .sketch_rebuild import SpanKeys, key_parts, rebuilt_sketch
from .summary import STORE_DTYPE


class StoreInvalid(Exception):
    """A store on disk that must not be used (reason in the message)."""


@dataclass
class SpanStore:
    """A loaded (verified) span store."""

    path: Path
    manifest: dict[str, Any]
    resident: dict[str, torch.Tensor]
    trace: dict[str, torch.Tensor]
    # the offload tier's flat buffers, from the file verified at load (not the path)
    _offload: dict[str, torch.Tensor] | None = None

    @property
    def offload(self) -> dict[str, torch.Tensor]:
        """The offload tier's flat fixed-rate buffers: decoded in memory where the file holds
        them entropy-coded (:mod:`sekv_core.rans`), else memory-mapped (pages read when
        sliced)."""
        if self._offload is None:
            mapped = map_safetensors(self.path / "offload.safetensors")
            self._offload = decoded_offload(self.manifest, self.resident, mapped)
        return self._offload

    def offload_slice(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of a flat offload buffer (reads only those pages)."""
        return self.offload[name][start:stop]

    def offload_records(self, name: str, size: int, ranges: RecordRanges) -> torch.Tensor:
        """Records (sum(counts), size) of the flat byte buffer ``name`` read as records of
        ``size`` bytes at ``ranges`` (indexed per record, not per byte)."""
        return self.offload[name].view(-1, size).index_select(0, ranges.index)  # (a row gather)

    @property
    def n_spans(self) -> int:
        return int(self.resident["span_starts"].numel())

    @property
    def bytes(self) -> dict[str, int]:
        return self.manifest["bytes"]


def load_store(
    path: Path,
    loaded: LoadedModel,
    document: Document,
    context: Context,
    settings: StoreSettings,
) -> SpanStore:
    """Load and verify the store of ``document`` read as ``context``; raise
    :class:`StoreInvalid` if it must not be used (also when missing or replaced meanwhile)."""
    try:
        manifest = read_manifest(path)
        check_claims(manifest, loaded, document, context, settings)
        with ExitStack() as files:
            opened = {name: files.enter_context(open(path / name, "rb")) for name in FILES}
            tensors = verified_tensors(manifest, opened)
    except OSError as exc:  # FileNotFoundError and the like: gone or replaced while read
        raise StoreInvalid(f"unreadable ({exc.strerror or exc}: {exc.filename})") from None
    resident, trace, offload = tensors
    check_tensors(resident, trace, context, manifest["positions"]["sinks"])
    try:
        restore_sinks(resident, loaded.model, context.ids)  # (the store keeps no sinks' rows)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise StoreInvalid(f"sinks cannot be recomputed ({exc})") from None
    offload = decoded_offload(manifest, resident, offload)
    if "sketch" not in resident:  # (a store whose fixes would outweigh its rows keeps them)
        resident["sketch"] = stored_sketch(manifest, resident, offload, loaded)
    check_sizes(manifest, resident, offload)
    place_resident(resident, loaded)
    return SpanStore(path, manifest, resident, trace, offload)


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the store at ``path``, its digest verified."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except ValueError as exc:
        raise StoreInvalid(f"manifest unreadable ({exc})") from None
    if not isinstance(manifest, dict):
        raise StoreInvalid("manifest is not a JSON object")
    if manifest.get("version") != FORMAT_VERSION:  # an older sekv's (no digest before 7)
        raise StoreInvalid(f"version is {manifest.get('version')!r}, expected {FORMAT_VERSION}")
    if manifest.get(DIGEST) != manifest_digest(manifest):
        raise StoreInvalid("manifest digest mismatch (edited or corrupt)")
    return manifest


def check_claims(
    manifest: dict[str, Any],
    loaded: LoadedModel,
    document: Document,
    context: Context,
    settings: StoreSettings,
) -> None:
    """StoreInvalid unless the manifest describes this model, document, context, settings."""
    T, start = len(context), context.doc_start
    bounded = exceeds_window(loaded.spec.window, T)  # as the streamed build lays it out
    expect = {
        ("format",): FORMAT,
        ("version",): FORMAT_VERSION,
        ("model", "fingerprint"): loaded.fingerprint,
        ("document", "sha256"): document.sha256,
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


def verified_tensors(manifest: dict[str, Any], opened: dict[str, Any]) -> tuple[dict, dict, dict]:
    """(resident, trace, offload maps) read from the ``opened`` files once each has the size
    and checksum the manifest lists."""
    listed = manifest.get("files")
    out = {}
    for name, f in opened.items():
        meta = listed.get(name) if isinstance(listed, dict) else None
        meta = meta if isinstance(meta, dict) else {}
        size = os.fstat(f.fileno()).st_size
        if size != meta.get("bytes"):
            raise StoreInvalid(f"{name} is {size} bytes, expected {meta.get('bytes')} (truncated?)")
        if name == "offload.safetensors":  # mapped, not held in memory
            digest, content = sha256(f), None
        else:
            content = f.read()
            digest = hashlib.sha256(content).hexdigest()
        if digest != meta.get("sha256"):
            raise StoreInvalid(f"{name} checksum mismatch (corrupt)")
        try:
            out[name] = map_safetensors(f) if content is None else load_bytes(content)
        except Exception as exc:  # safetensors raises its own error types
            raise StoreInvalid(f"{name}: unreadable tensors ({exc})") from None
    for name in ("resident.safetensors", "trace.safetensors"):
        try:
            unpack(out[name])  # its tensors, in one LZMA stream
        except ValueError as exc:
            raise StoreInvalid(f"{name}: {exc}") from None
    try:
        unconstrain(out["resident.safetensors"])  # bases and the sketch's B, from their equations
        widen(out["resident.safetensors"])  # the codebooks' bases, stored in 8 bits
    except ValueError as exc:
        raise StoreInvalid(f"resident.safetensors: {exc}") from None
    return out["resident.safetensors"], out["trace.safetensors"], out["offload.safetensors"]


def check_tensors(
    resident: dict[str, torch.Tensor], trace: dict[str, torch.Tensor], context: Context, sinks: int
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


def decoded_offload(
    manifest: dict[str, Any], resident: dict[str, torch.Tensor], offload: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The offload tier's fixed-rate buffers of the verified file's tensors (decoded where the
    store holds them entropy-coded, :mod:`sekv_core.rans`)."""
    settings = manifest["settings"]
    try:
        codes = store_codebooks(resident, settings["key_code"], settings["value_code"])
        return expanded(offload, resident["part_rows"], codes)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise StoreInvalid(f"offload tier cannot be decoded ({exc})") from None


def stored_sketch(
    manifest: dict[str, Any],
    resident: dict[str, torch.Tensor],
    offload: dict[str, torch.Tensor],
    loaded: LoadedModel,
) -> torch.Tensor:
    """The routing sketch's rows, rebuilt from the verified offload tier's keys and the
    stored fixes (the store keeps no rows, :mod:`sekv_core.sketch_rebuild`)."""
    settings = manifest["settings"]
    try:
        spec = settings["key_code"]
        parts = key_parts(offload["k_rows"], resident["part_rows"])
        rope = None if manifest["positions"]["mode"] == "bounded" else Rope(loaded.model)
        return rebuilt_sketch(SpanKeys(resident, parts, spec, rope, settings["sketch_bits"]))
    except (KeyError, RuntimeError, ValueError) as exc:  # tables that do not fit each other
        raise StoreInvalid(f"sketch cannot be rebuilt ({exc})") from None


def check_sizes(
    manifest: dict[str, Any], resident: dict[str, torch.Tensor], offload: dict[str, torch.Tensor]
) -> None:
    """StoreInvalid unless the manifest's tier sizes (what ingest and answers report) are those
    of the stored tensors, the decoded records and the files."""
    files = {name: manifest["files"][name]["bytes"] for name in FILES}
    expect = {
        **tier_bytes(resident),
        "offloaded": files["offload.safetensors"],
        "offload_records": nbytes(offload),
        "store": sum(files.values()),
    }
    sizes = manifest.get("bytes")
    for name, value in expect.items():
        found = sizes.get(name) if isinstance(sizes, dict) else None
        if found != value:
            raise StoreInvalid(f"bytes.{name} is {found!r}, the store holds {value}")


def place_resident(resident: dict[str, torch.Tensor], loaded: LoadedModel) -> None:
    """The resident tier at the precision and on the device answers use it."""
    device = loaded.device
    # the resident tier stays in half precision on the device (fp32 models compute on copies)
    dtype = loaded.dtype if loaded.dtype.itemsize <= 2 else STORE_DTYPE
    resident["sketch_mean"] = resident["sketch_mean"].to(device=device, dtype=dtype)
    resident["sketch"] = column_major(resident["sketch"])  # the layout routing reads fastest
    # SpanMemory places these: sinks' and anchors' K/V at the answer's precision, the sketch's
    # directions an answer routes with
    for name in ("fixed_k", "fixed_v", "sketch_proj", "sketch_scale"):
        if resident[name].is_floating_point():  # (8-bit fixed rows stay as they are)
            resident[name] = resident[name].to(dtype=dtype)
    if "span_reps" in resident:
        resident["span_reps"] = resident["span_reps"].to(device)
