"""A span store loaded from disk and verified: what answering reads, tier by tier.

Loading checks format, model, document, settings and every file's size and checksum
(:mod:`sekv_core.format`); a store that fails raises :class:`StoreInvalid` and is never used
(:func:`sekv_core.ingest.open_or_build` rebuilds it). The resident tier is read whole; the
offload tier is memory-mapped and sliced per zoom.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from .config import StoreSettings
from .documents import Document
from .format import FILES, FORMAT, FORMAT_VERSION, map_safetensors, sha256
from .models import LoadedModel
from .reconstruct import RecordRanges
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
    _offload: dict[str, torch.Tensor] | None = None  # flat buffers mapped from the file

    @property
    def offload(self) -> dict[str, torch.Tensor]:
        """The offload tier's flat buffers, memory-mapped (pages are read when sliced)."""
        if self._offload is None:
            self._offload = map_safetensors(self.path / "offload.safetensors")
        return self._offload

    def offload_slice(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of a flat offload buffer (reads only those pages)."""
        return self.offload[name][start:stop]

    def offload_records(self, name: str, size: int, ranges: RecordRanges) -> torch.Tensor:
        """Records (sum(counts), size) of the flat byte buffer ``name`` read as records of
        ``size`` bytes at ``ranges`` (indexed per record, not per byte)."""
        return self.offload[name].view(-1, size)[ranges.index]

    @property
    def n_spans(self) -> int:
        return int(self.resident["span_starts"].numel())

    @property
    def bytes(self) -> dict[str, int]:
        return self.manifest["bytes"]


def load_store(
    path: Path, loaded: LoadedModel, document: Document, settings: StoreSettings
) -> SpanStore:
    """Load and verify a store; raise :class:`StoreInvalid` if it must not be used."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise StoreInvalid(f"manifest unreadable ({exc})") from None
    expect = {
        ("format",): FORMAT,
        ("version",): FORMAT_VERSION,
        ("model", "fingerprint"): loaded.fingerprint,
        ("document", "sha256"): document.sha256,
        ("settings",): json.loads(json.dumps(settings.to_dict())),
    }
    for keys, value in expect.items():
        found: Any = manifest
        for k in keys:
            found = found.get(k) if isinstance(found, dict) else None
        if found != value:
            raise StoreInvalid(f"{'.'.join(keys)} is {found!r}, expected {value!r}")
    for name in FILES:
        meta = manifest.get("files", {}).get(name, {})
        file = path / name
        if not file.is_file() or file.stat().st_size != meta.get("bytes"):
            raise StoreInvalid(f"{name} missing or truncated")
        if sha256(file) != meta.get("sha256"):
            raise StoreInvalid(f"{name} checksum mismatch (corrupt)")
    try:
        resident = load_file(path / "resident.safetensors")
        trace = load_file(path / "trace.safetensors")
    except Exception as exc:  # safetensors raises its own error types
        raise StoreInvalid(f"unreadable tensors ({exc})") from None
    device = loaded.device
    # the resident tier stays in half precision on the device (fp32 models compute on copies)
    dtype = loaded.dtype if loaded.dtype.itemsize <= 2 else STORE_DTYPE
    resident["sketch_mean"] = resident["sketch_mean"].to(device=device, dtype=dtype)
    # SpanMemory places these: sinks' and anchors' K/V at the answer's precision, the sketch's
    # directions an answer routes with
    for name in ("fixed_k", "fixed_v", "sketch_proj", "sketch_scale"):
        resident[name] = resident[name].to(dtype=dtype)
    if "span_reps" in resident:
        resident["span_reps"] = resident["span_reps"].to(device)
    return SpanStore(path, manifest, resident, trace)
