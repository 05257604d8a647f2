"""The span store's on-disk format: file layout, key, manifest, checksums, atomic writes.

One directory per (document, model, settings) under ``$SEKV_HOME/stores``; safetensors for
tensors (never pickle):

- ``resident.safetensors`` — what answering places on the device (K/V of sinks and anchors, as
  the 8-bit rows answers hold them where positions are original; the routing sketch's
  directions and scales, span lengths and representatives) and the host-side index beside it
  (span bounds, the parts' first rows, the offload code's codebooks, the sketch's key
  directions and fixes). The sketch's rows are not written: loading rebuilds them from the
  offload tier's keys (:mod:`sekv_core.sketch_rebuild`; a long book keeps them), nor are the
  sinks' rows where positions are original: loading recomputes them from the context's first
  tokens (:mod:`sekv_core.sinks`). The codebooks' bases are kept in 8 bits
  (:mod:`sekv_core.narrow`), read back as the fp16 numbers the build used; they and the
  sketch's key directions are written as what their equations leave free plus residuals
  (:mod:`sekv_core.constrained`), read back bit for bit; all but the fixes in one LZMA stream
  (:mod:`sekv_core.packed`);
- ``offload.safetensors`` — the offload tier: every span token's pre-RoPE key and value as a
  fixed-size record of the document's code (:mod:`sekv_core.codec`), ``k_rows`` / ``v_rows``
  flat bytes, per part (L, H, rows, record) in row order. Where the sketch is rebuilt at load
  the records are entropy-coded (``k_coded``, ``k_coded_bytes``, ``k_params``, ``k_check``,
  the same for ``v``; :mod:`sekv_core.rans`) and decoded whole at load, bit for bit; a long
  book's are kept as they are, memory-mapped and sliced per zoom;
- ``trace.safetensors`` — token metadata for explanations (ids, surprisal, roles, pages, offsets),
  in one LZMA stream;
- ``manifest.json`` — format version, model id + fingerprint, tokenizer, settings, document,
  positions (``original``, or ``bounded`` for books: keys pre-RoPE, see :mod:`sekv_core.zoom`),
  sha256 + size of every file, bytes per tier, statistics, and ``digest``: the sha256 of all of
  that (:func:`manifest_digest`), so no value in it is trusted unchecked. Written last.

A store is written into a ``.tmp-*`` sibling that records its writer (a dead writer's is removed
at the next build, :mod:`sekv_core.locks`), then renamed into place; store directories are 0700.

``bytes`` in the manifest: ``resident`` is the device tier as an answer holds it (sinks' and
anchors' K/V as 8-bit rows, :mod:`sekv_core.kvquant`), the number ``sekv ask --json`` reports
as ``resident_tier_bytes``; ``index`` the host-side rest of ``resident.safetensors``;
``offloaded`` the offload tier on disk (the size of ``offload.safetensors``);
``offload_records`` the same tier as answers read it, its fixed-rate records (in host memory,
or mapped); ``store`` the three
files' sizes together (what the store costs on disk, besides this manifest); ``full_kv_fp16``
the reference every memory share divides by.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from safetensors.torch import save_file

from .config import StoreSettings
from .constrained import constrain
from .documents import Document, token_pages
from .kvquant import KV_BITS, quantize_rows, row_bytes
from .locks import WRITER, mark_writer
from .models import LoadedModel
from .narrow import narrow
from .packed import pack
from .prompt import Context

FORMAT = "sekv-span-store"
FORMAT_VERSION = 14  # 14: bases and the sketch's B coded by their equations (13: sinks recomputed)
FILES = ("resident.safetensors", "offload.safetensors", "trace.safetensors")
# resident tensors an answer places on the device (the rest is the host index)
DEVICE_TENSORS = ("sketch_proj", "sketch_mean", "sketch", "sketch_scale", "span_reps")
# resident tensors not written where the store holds their fixes: rebuilt at load from the
# offload tier (:mod:`sekv_core.sketch_rebuild`)
REBUILT = {"sketch": "sketch_fixes"}
FIXED_SCALES = {"fixed_k": "fixed_k_scale", "fixed_v": "fixed_v_scale"}  # 8-bit fixed rows'
RECOMPUTED = "sinks_recomputed"  # int64 (1,): how many leading fixed rows a load recomputes
# the offload code's codebooks (half precision, the bases 8-bit on disk; host index: zoomed rows
# are decoded on the host)
# (an allocated code's also its metric and bits, an even code's its step: a store holds the
# names its code has)
CODEBOOK_PARTS = ("basis", "mean", "range", "metric", "bits", "step")
CODEBOOKS = tuple(f"{kind}_{name}" for kind in "kv" for name in CODEBOOK_PARTS)
DIGEST = "digest"  # the manifest's own checksum (of every other field)


def store_key(loaded: LoadedModel, document: Document, context: Context, settings: Any) -> str:
    """Directory name: hash of document, model fingerprint, prompt tokens, settings, format."""
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


def tier_bytes(resident: dict[str, torch.Tensor]) -> dict[str, int]:
    """Bytes of the device tier as an answer holds it, and of the host index (the rest).

    The device tier: sinks' and anchors' K and V as 8-bit rows, the routing sketch and its
    directions at 2 bytes per number, each span's length (int64), each span token's span
    (int64) and the spans' representative rows.
    """
    L, H, F, D = resident["fixed_k"].shape
    spans = int(resident["span_starts"].numel())
    span_tokens = int((resident["span_ends"] - resident["span_starts"]).sum())
    device = 2 * L * H * F * row_bytes(D, KV_BITS) + 8 * (spans + span_tokens)
    for name in DEVICE_TENSORS:
        t = resident.get(name)
        if t is not None:
            device += t.numel() * (2 if t.is_floating_point() else t.element_size())
    return {"resident": device, "index": nbytes(resident) - _stored(resident)}


def quantize_fixed(resident: dict[str, torch.Tensor]) -> None:
    """Sinks' and anchors' K/V (fp16) replaced, in place, by the 8-bit rows answers hold them
    as (:mod:`sekv_core.kvquant`: codes and one scale per row): a store of original positions
    keeps them so (a bounded store's keys are rotated at load before they are quantised, so
    they stay fp16)."""
    for name, scale in FIXED_SCALES.items():
        resident[name], resident[scale] = quantize_rows(resident[name])


def on_disk(resident: dict[str, torch.Tensor], sinks: int) -> dict[str, torch.Tensor]:
    """The resident tensors a store's file holds: all but those rebuilt at load (the sketch's
    rows where it keeps fixes; the first ``sinks`` fixed rows where they are 8-bit rows of
    original positions, marked :data:`RECOMPUTED`: :mod:`sekv_core.sinks`), the codebooks'
    bases in 8 bits (:func:`sekv_core.narrow.narrow`), they and the sketch's key projection
    coded by their equations (:func:`sekv_core.constrained.constrain`), in one LZMA stream
    (:func:`sekv_core.packed.pack`)."""
    dropped = {name for name, fixes in REBUILT.items() if fixes in resident}
    out = {name: t for name, t in resident.items() if name not in dropped}
    if sinks and out["fixed_k"].dtype == torch.int8:  # (a book's fp16 sinks are kept)
        for name in (*FIXED_SCALES, *FIXED_SCALES.values()):
            out[name] = out[name][:, :, sinks:]
        out[RECOMPUTED] = torch.tensor([sinks])
    return pack(constrain(narrow(out)))


def _stored(resident: dict[str, torch.Tensor]) -> int:
    """Bytes of the device tier's tensors as stored in the file."""
    names = ("fixed_k", "fixed_v", *FIXED_SCALES.values(), *DEVICE_TENSORS)
    return nbytes({n: resident[n] for n in names if n in resident})


def store_manifest(
    loaded: LoadedModel,
    document: Document,
    context: Context,
    settings: StoreSettings,
    positions: dict[str, Any],
) -> dict[str, Any]:
    """The manifest's fixed part (``bytes``, ``stats`` and ``timings`` are filled by builders)."""
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
        "settings": settings.to_dict(),
        "document": {
            "path": str(document.path),
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


def code_stats(key: Any, value: Any) -> dict[str, Any]:
    """The offload code of keys and values (:class:`sekv_core.codec.Codebook`): bits per stored
    number, scales included."""
    dim = key.basis.shape[-1]
    return {
        "key_bits": round(8 * key.record_bytes / dim, 3),
        "value_bits": round(8 * value.record_bytes / dim, 3),
    }


def write_atomically(
    path: Path,
    files: dict[str, dict[str, torch.Tensor]],
    manifest: dict,
    writers: dict[str, Callable[[Path], None]] | None = None,
) -> None:
    """Write ``files`` (and the files ``writers`` write to the path they get) + the manifest
    (with its sizes, checksums and digest) into a temporary sibling directory (0700, marked
    with this writer), then rename it to ``path``."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))  # 0700
    try:
        mark_writer(tmp)
        manifest["files"] = {}
        for name in [*files, *(writers or {})]:
            if name in files:
                tensors = files[name]
                save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / name))
            else:
                writers[name](tmp / name)
            manifest["files"][name] = {
                "sha256": sha256(tmp / name),
                "bytes": (tmp / name).stat().st_size,
            }
        sizes = manifest.get("bytes")
        if isinstance(sizes, dict):  # a span store: the tiers as the files hold them
            files_bytes = {n: f["bytes"] for n, f in manifest["files"].items()}
            if "offload.safetensors" in files_bytes:
                sizes["offloaded"] = files_bytes["offload.safetensors"]
            sizes["store"] = sum(files_bytes.values())
        manifest.pop(DIGEST, None)
        manifest[DIGEST] = manifest_digest(json.loads(json.dumps(manifest)))  # as it reads back
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
        _replace(tmp, path)
        (path / WRITER).unlink(missing_ok=True)  # (killed just before: a harmless extra file)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace(tmp: Path, path: Path) -> None:
    """Rename the finished ``tmp`` to ``path``, a stale or corrupt store there deleted first
    (renamed away, so a reader never sees half of it)."""
    if path.exists():
        trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
        shutil.rmtree(trash, ignore_errors=True)  # a dead process's of the same pid
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(tmp, path)


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The sha256 of the canonical manifest (sorted-keys compact JSON of every field but
    :data:`DIGEST`): it covers the files' checksums and sizes, positions, document, bytes."""
    body = {k: v for k, v in manifest.items() if k != DIGEST}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def map_safetensors(
    source: Path | BinaryIO, names: tuple[str, ...] | None = None
) -> dict[str, torch.Tensor]:
    """Memory-map the 1-D tensors (``names``: only those) of a safetensors file (a path, or a
    file open for binary reading: the maps stay valid after it is replaced or deleted) as
    read-only torch views (no copy)."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            return map_safetensors(f, names)
    source.seek(0)
    header_len = int.from_bytes(source.read(8), "little")
    header = json.loads(source.read(header_len))
    dtypes = {
        "F16": np.float16,
        "F32": np.float32,
        "I64": np.int64,
        "I32": np.int32,
        "I8": np.int8,
        "U8": np.uint8,
    }
    out = {}
    for name, meta in header.items():
        if name == "__metadata__" or (names is not None and name not in names):
            continue
        start, stop = meta["data_offsets"]
        dtype = np.dtype(dtypes[meta["dtype"]])
        count = (stop - start) // dtype.itemsize
        if count == 0:
            out[name] = torch.zeros(0, dtype=getattr(torch, dtype.name))
            continue
        array = np.memmap(
            source, dtype=dtype, mode="r", offset=8 + header_len + start, shape=(count,)
        )
        with warnings.catch_warnings():  # read-only map: torch warns it is not writable
            warnings.simplefilter("ignore")
            out[name] = torch.from_numpy(array)
    return out


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
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
