"""Writing a span store: the one finishing path of the one-shot and the streamed build.

:func:`write_store` codes what the files hold (sinks' and anchors' K/V as 8-bit rows, the
records entropy-coded), fills the manifest's sizes and writes the directory atomically: into a
``.tmp-*`` sibling that records its writer (a dead writer's is removed at the next build,
:mod:`sekv_core.locks`), then renamed into place.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..errors import SekvError
from ..kvquant import quantize_rows
from ..locks import WRITER, mark_writer
from ..prefill import release_freed_memory
from .codes import Code
from .entropy import compacted
from .format import (
    DIGEST,
    StoreSource,
    device_bytes,
    manifest_digest,
    nbytes,
    sha256,
    sketch_rows,
    store_manifest,
    stored_sketch,
)
from .resident import FIXED_SCALES, SKETCH_TABLES, TABLES, SpanTables

SPARE_BYTES = 1 << 20  # free space kept beyond the files' own bytes (headers, the manifest)


@dataclass
class BuiltStore:
    """What a builder hands :func:`write_store`. A store without span tokens writes neither its
    codes nor the sketch's tables (a load supplies them: :func:`~.load.spanless`)."""

    positions: dict[str, Any]  # the manifest's positions (mode, sinks)
    tables: SpanTables  # fixed K/V float: keys post-RoPE at their positions (bounded: pre-RoPE)
    codes: dict[str, Code]  # the offload codes, k and v (their numbers: those the file holds)
    records: dict[str, torch.Tensor]  # (L, H, S, B) uint8, contiguous; emptied once written
    trace: dict[str, torch.Tensor]  # format.trace_tensors
    report: dict[str, Any]  # the manifest sections it adds (stats, timings, a stream's report)


def write_store(path: Path, source: StoreSource, built: BuiltStore) -> None:
    """Write the store of ``source`` built as ``built`` at ``path``."""
    tables, codes, records, report = built.tables, built.codes, built.records, built.report
    settings = source.settings
    rows = records["k"].shape[2]
    stored = tables.stored()  # the file's precision: what a load reads (and a sketch is of)
    resident = {name: getattr(stored, name) for name in TABLES}
    for name, scale in FIXED_SCALES.items():  # sinks' and anchors' K/V as 8-bit rows
        resident[name], resident[scale] = quantize_rows(getattr(tables, name).float().cpu())
    if rows:  # a store without span tokens holds neither the sketch's tables nor codes
        resident.update({name: getattr(stored, name) for name in SKETCH_TABLES})
        resident.update({**codes["k"].tensors("k"), **codes["v"].tensors("v")})
    manifest = store_manifest(source, built.positions)
    if stored_sketch(manifest) and rows:  # a bounded store's sketch, of pre-RoPE keys as decoded
        keys, bits = records["k"].view(-1), settings.sketch_bits
        resident["sketch"] = sketch_rows(stored, keys, codes["k"], None, bits)
    offload = compacted(records, codes)
    manifest["bytes"].update(
        resident=device_bytes(tables, settings.sketch_bits),
        offload_records=sum(r.numel() for r in records.values()),
    )
    per_number = 8 / codes["k"].basis.shape[-1]  # bits per number of a fixed-rate record
    manifest["stats"] = report.pop("stats", {})
    manifest["stats"]["key_bits"] = round(codes["k"].record_bytes * per_number, 3)
    manifest["stats"]["value_bits"] = round(codes["v"].record_bytes * per_number, 3)
    manifest.update(report)
    files = {"resident.safetensors": resident, "offload.safetensors": offload}
    write_atomically(path, {**files, "trace.safetensors": built.trace}, manifest)
    del files, offload  # the coding, written
    records.clear()
    release_freed_memory()


def write_atomically(
    path: Path, files: dict[str, dict[str, torch.Tensor]], manifest: dict[str, Any]
) -> None:
    """Write ``files`` (safetensors) and the manifest — with every file's sha256 and size, the
    store's sizes when it has ``bytes``, and its digest — into a temporary sibling directory
    (0700, marked with this writer), then rename it to ``path``."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    needed = sum(nbytes(tensors) for tensors in files.values())
    if shutil.disk_usage(path.parent).free < needed + SPARE_BYTES:
        raise _no_space(path, needed)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))  # 0700
    try:
        mark_writer(tmp)
        manifest["files"] = {}
        for name, tensors in files.items():
            save_tensors(tensors, tmp / name, path, needed)
            size = (tmp / name).stat().st_size
            manifest["files"][name] = {"sha256": sha256(tmp / name), "bytes": size}
        sizes = manifest.get("bytes")
        listed = {name: meta["bytes"] for name, meta in manifest["files"].items()}
        if isinstance(sizes, dict) and "offload.safetensors" in listed:  # a span store's sizes
            sizes["index"] = listed["resident.safetensors"]
            sizes["offloaded"] = listed["offload.safetensors"]
            sizes["trace"] = listed["trace.safetensors"]
            sizes["store"] = sum(listed.values())
        manifest.pop(DIGEST, None)
        manifest[DIGEST] = manifest_digest(json.loads(json.dumps(manifest)))  # as it reads back
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
        _replace(tmp, path)
        (path / WRITER).unlink(missing_ok=True)  # (killed just before: a harmless extra file)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_tensors(tensors: dict[str, torch.Tensor], file: Path, store: Path, needed: int) -> None:
    """``tensors`` as a safetensors ``file`` of the store at ``store``; a full disk is a
    SekvError saying how much the store needs (``needed`` bytes) and where."""
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(file))
    except Exception as exc:  # OSError, or safetensors' own error carrying errno 28
        if getattr(exc, "errno", None) == errno.ENOSPC or "os error 28" in str(exc):
            raise _no_space(store, needed) from None
        raise


def _no_space(path: Path, needed: int) -> SekvError:
    return SekvError(
        f"no space left for the span store: it needs about {needed / 2**20:,.1f} MiB free under "
        f"{path.parent} ($SEKV_HOME/stores); free some space (`sekv stores prune`) or set "
        "SEKV_HOME to a disk with room"
    )


def _replace(tmp: Path, path: Path) -> None:
    """Rename the finished ``tmp`` to ``path``, a stale or corrupt store there deleted first
    (renamed away, so a reader never sees half of it)."""
    if path.exists():
        trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
        shutil.rmtree(trash, ignore_errors=True)  # a dead process's of the same pid
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(tmp, path)
