"""The span store on disk: one directory per (document, model, settings) under $SEKV_HOME/stores.

Files (safetensors, never pickle) and what they hold:

- ``resident.safetensors`` — the device tier: K/V of sinks and anchors, span summaries, span
  bounds and the per-span offset/rank tables of the bases;
- ``offload.safetensors`` — the offload tier: flat fp16 low-rank factors of every span's keys and
  values; memory-mapped, sliced per zoom, never read whole;
- ``trace.safetensors`` — token metadata for explanations (ids, surprisal, roles, pages, offsets);
- ``manifest.json`` — format version, model id + fingerprint, tokenizer, settings, document,
  positions (``original``, or ``bounded`` for books: keys pre-RoPE, see :mod:`sekv_core.zoom`),
  sha256 + size of every file, per-tier bytes, statistics. Written last.

A store is built in a temporary sibling directory and renamed into place, so an interrupted build
never leaves a directory that loads. Loading verifies format, model, document, settings and
checksums; :func:`open_or_build` rebuilds (with a warning) any store that fails. A context longer
than the model window is read by the streamed builder (:mod:`sekv_core.stream`), which can resume
an interrupted build.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .basis import BASIS_DTYPE, factorize, gather_spans, summarize
from .documents import Document, token_pages
from .errors import SekvError
from .models import LoadedModel
from .paths import sekv_home
from .prefill import Progress, prefill
from .prompt import Context
from .rope import Rope
from .segment import ANCHOR, SINK, SPAN, SegmentSettings, segment
from .sketch import quantize_sketch, sketch_basis

FORMAT = "sekv-span-store"
FORMAT_VERSION = 3  # 2: positions (original | bounded), streamed books; 3: query-weighted sketch
SLICED_RANGES = 32  # offload reads of up to this many ranges slice them one by one
FILES = ("resident.safetensors", "offload.safetensors", "trace.safetensors")
ANSWER_RESERVE = 32  # tokens kept free for the question and the start of an answer


@dataclass(frozen=True)
class StreamSettings:
    """Streamed ingest of a context beyond the model window (:mod:`sekv_core.stream`).

    Each chunk attends to the sinks, the previous ``window`` tokens at full resolution and
    ``budget`` tokens per (layer, KV head) zoomed from the store built so far, routed by
    ``route_queries`` of its queries.
    """

    window: int = 2048
    budget: int = 512
    route_queries: int = 16
    always: bool = False  # stream even a context that fits the window (tests, comparisons)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StoreSettings:
    """Everything that changes a store's content (part of its key)."""

    segment: SegmentSettings = field(default_factory=SegmentSettings)
    # spectrum share kept by the bases; measured on the default model: keys below 0.99 lose a
    # needle's digits (0.9: 0/4, 0.95: 1/4, 0.99: 4/4 at budget 256); following full KV's answers
    # token by token needs more (every span zoomed, 26 questions: keys / values at 0.99 / 0.95
    # agree on 0.938 of the answer tokens, 0.99 / 0.99 on 0.975, 0.999 / 0.999 on 0.993; under
    # 10 / 15 / 20% memory targets 0.767 / 0.883 / 0.898 -> 0.788 / 0.885 / 0.914). The price is
    # the offload tier: ~0.75 -> ~0.97 of a raw fp16 cache (most 32-token spans are stored raw)
    key_energy: float = 0.999
    value_energy: float = 0.999
    sketch_dim: int = 32  # routing sketch dims per span token (see sekv_core.sketch; measured:
    # 16 dims agree with full KV on 0.851 / 0.885 of answer tokens under 15 / 20% targets, 32 on
    # 0.871 / 0.894)
    sketch_bits: int = 4  # its quantisation (4: two values per byte; 8: int8)
    prefill_chunk: int = 512
    stream: StreamSettings = field(default_factory=StreamSettings)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_span_tokens(self, low: int, high: int) -> StoreSettings:
        """These settings with spans of ``low``..``high`` tokens."""
        return replace(self, segment=replace(self.segment, min_len=low, max_len=high))


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

    def offload_ranges(self, name: str, starts: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
        """Elements [starts[i], stops[i]) of a flat offload buffer for every i, one after
        another (reads only those pages): a few ranges are sliced, many gathered by one index
        (measured: slicing ~10 long spans' rows costs a third of building their index)."""
        buf = self.offload[name]
        if starts.numel() > SLICED_RANGES:
            return buf[ranges_index(starts, stops)]
        pairs = zip(starts.tolist(), stops.tolist(), strict=True)
        return torch.cat([buf[a:b] for a, b in pairs]) if starts.numel() else buf[:0]

    @property
    def n_spans(self) -> int:
        return int(self.resident["span_starts"].numel())

    @property
    def bytes(self) -> dict[str, int]:
        return self.manifest["bytes"]


def ranges_index(starts: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
    """The indices of ranges [starts[i], stops[i]) one after another (int64)."""
    sizes = stops - starts
    first = torch.cumsum(sizes, 0) - sizes
    which = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    return starts[which] + torch.arange(int(sizes.sum())) - first[which]


def padded_blocks(
    flat: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, shape: tuple[int, int, int]
) -> torch.Tensor:
    """Zero-padded blocks ``shape`` (n, A, B) from ``flat``: block i's rows[i] x cols[i]
    row-major elements, one block after another."""
    sizes = rows * cols
    block = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)  # (total,)
    within = torch.arange(flat.numel()) - (torch.cumsum(sizes, 0) - sizes)[block]
    out = flat.new_zeros(shape)
    out[block, within // cols[block], within % cols[block]] = flat
    return out


@contextmanager
def one_thread() -> Iterator[None]:
    """Run a block on one intra-op thread: batches of small eigendecompositions are up to 100x
    slower with several (the batch loop and LAPACK compete for the cores), worst on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def exceeds_window(loaded: LoadedModel, context: Context) -> bool:
    """The context leaves no room for a question in the model window: a book."""
    return len(context) + ANSWER_RESERVE > loaded.spec.window


def span_representatives(
    surprisal: torch.Tensor, lengths: torch.Tensor, count: int = 4
) -> torch.Tensor:
    """Sketch rows of each span's ``count`` highest-surprisal tokens (names, numbers, the facts
    a question asks for): (N, count) int64, a short span repeating its best row.

    surprisal : (S,) of the span tokens in sketch-row order; lengths : (N,).
    """
    first = torch.cumsum(lengths, 0) - lengths  # (N,)
    width = int(lengths.max()) if len(lengths) else 0
    within = torch.arange(width)[None]  # (1, M)
    rows = (first[:, None] + within).clamp(max=max(len(surprisal) - 1, 0))  # (N, M)
    h = surprisal[rows] if len(surprisal) else torch.zeros(rows.shape)
    h = h.masked_fill(within >= lengths[:, None], float("-inf"))
    k = min(count, width)
    best = h.topk(k, dim=1).indices if k else torch.zeros(len(lengths), 0, dtype=torch.long)
    best = torch.minimum(best, (lengths[:, None] - 1).clamp(min=0))  # short spans: repeat
    reps = first[:, None] + best
    if k < count:
        reps = torch.cat([reps, reps[:, :1].expand(-1, count - k)], dim=1)
    return reps


def map_safetensors(path: Path, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """Memory-map the 1-D tensors (``names``: only those) of a safetensors file as read-only
    torch views (no copy)."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
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
            path, dtype=dtype, mode="r", offset=8 + header_len + start, shape=(count,)
        )
        with warnings.catch_warnings():  # read-only map: torch warns it is not writable
            warnings.simplefilter("ignore")
            out[name] = torch.from_numpy(array)
    return out


def store_key(
    loaded: LoadedModel, document: Document, context: Context, settings: StoreSettings
) -> str:
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


def open_or_build(
    loaded: LoadedModel,
    document: Document,
    context: Context,
    settings: StoreSettings | None = None,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
) -> tuple[SpanStore, bool]:
    """Load the document's store if a valid one exists, else build it. Returns (store, cache_hit).

    A stale, foreign or corrupt store is rebuilt, and ``warn`` is told why.
    """
    settings = settings or StoreSettings()
    path = sekv_home() / "stores" / store_key(loaded, document, context, settings)
    if path.exists():
        try:
            return load_store(path, loaded, document, settings), True
        except StoreInvalid as exc:
            if warn:
                warn(f"rebuilding the span store at {path}: {exc}")
    try:
        if settings.stream.always or exceeds_window(loaded, context):
            from .stream import build_streamed  # the streamed builder imports this module

            build_streamed(path, loaded, document, context, settings, progress, warn)
        else:
            build_store(path, loaded, document, context, settings, progress)
    except OSError as exc:
        raise SekvError(
            f"cannot write the span store under {path.parent} ({exc.strerror or exc}); "
            "set SEKV_HOME to a writable directory with free space"
        ) from None
    return load_store(path, loaded, document, settings), False


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
        if _sha256(file) != meta.get("sha256"):
            raise StoreInvalid(f"{name} checksum mismatch (corrupt)")
    try:
        resident = load_file(path / "resident.safetensors")
        trace = load_file(path / "trace.safetensors")
    except Exception as exc:  # safetensors raises its own error types
        raise StoreInvalid(f"unreadable tensors ({exc})") from None
    device = loaded.device
    # the resident tier stays in half precision on the device (fp32 models compute on copies)
    dtype = loaded.dtype if loaded.dtype.itemsize <= 2 else BASIS_DTYPE
    resident["sketch_mean"] = resident["sketch_mean"].to(device=device, dtype=dtype)
    # SpanMemory places these: sinks' and anchors' K/V at the answer's precision, the summaries
    # when an answer reads them, the sketch's directions an answer routes with (all, or the
    # strongest half under a tight memory target)
    for name in ("fixed_k", "fixed_v", "summary_k", "summary_v", "sketch_proj", "sketch_scale"):
        resident[name] = resident[name].to(dtype=dtype)
    if "span_reps" in resident:
        resident["span_reps"] = resident["span_reps"].to(device)
    return SpanStore(path, manifest, resident, trace)


def build_store(
    path: Path,
    loaded: LoadedModel,
    document: Document,
    context: Context,
    settings: StoreSettings,
    progress: Progress | None = None,
) -> None:
    """Prefill, segment, factorise and write a store atomically at ``path``."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    pre = prefill(loaded.model, context.ids, settings.prefill_chunk, progress)
    timings["prefill_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    seg = segment(pre.surprisal, context.doc_start, settings.segment)
    starts, ends = torch.from_numpy(seg.starts), torch.from_numpy(seg.ends)
    lengths = ends - starts
    fixed = torch.from_numpy(np.flatnonzero(seg.roles != SPAN))  # sinks + anchors, ascending
    keys, values = pre.keys.float(), pre.values.float()  # (L, H, T, D) post-RoPE
    rope = Rope(loaded.model)
    keys_pre = rope.unrotate(keys, torch.arange(len(context)))  # bases compress pre-RoPE keys
    k_blocks = gather_spans(keys_pre, starts, ends)  # (L, H, N, M, D)
    v_blocks = gather_spans(values, starts, ends)
    weights = gather_spans(torch.from_numpy(pre.surprisal)[:, None], starts, ends)[..., 0]
    summary_pre, summary_v = summarize(k_blocks, v_blocks, weights, lengths)
    summary_k = rope.rotate(summary_pre, (starts + ends - 1) // 2)  # at each span's centre
    span_tokens = torch.from_numpy(np.flatnonzero(seg.roles == SPAN))  # spans in order
    with one_thread():
        span_keys = keys[:, :, span_tokens]
        basis = sketch_basis(span_keys, pre.query_moment, settings.sketch_dim)
        sketch = basis.project(span_keys)
    timings["segment_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    with one_thread():
        kb = factorize(k_blocks, lengths, settings.key_energy)
        vb = factorize(v_blocks, lengths, settings.value_energy)
    timings["basis_s"] = time.perf_counter() - t0

    quantized = quantize_sketch(sketch, settings.sketch_bits)
    resident = {
        "fixed_pos": fixed,
        "fixed_k": keys[:, :, fixed].to(BASIS_DTYPE),
        "fixed_v": values[:, :, fixed].to(BASIS_DTYPE),
        "span_starts": starts,
        "span_ends": ends,
        "summary_k": summary_k.to(BASIS_DTYPE),
        "summary_v": summary_v.to(BASIS_DTYPE),
        "sketch_proj": basis.query_proj.to(BASIS_DTYPE),
        "sketch_mean": basis.mean.to(BASIS_DTYPE),
        **quantized,
        "span_reps": span_representatives(torch.from_numpy(pre.surprisal)[span_tokens], lengths),
        **kb.tables("k"),
        **vb.tables("v"),
    }
    offload = {"k_coef": kb.coef, "k_basis": kb.basis, "v_coef": vb.coef, "v_basis": vb.basis}
    trace = trace_tensors(document, context, pre.surprisal, seg.roles)
    positions = {"mode": "original", "sinks": n_sinks(context, settings)}
    manifest = store_manifest(loaded, document, context, settings, positions)
    manifest["bytes"].update(
        resident=_nbytes(resident), offloaded=_nbytes(offload), trace=_nbytes(trace)
    )
    manifest["stats"] = {
        **seg.stats(),
        **rank_stats(kb.rank, kb.raw, vb.rank, vb.raw),
    }
    manifest["timings"] = {k: round(v, 4) for k, v in timings.items()}
    _write_atomically(
        path,
        {
            "resident.safetensors": resident,
            "offload.safetensors": offload,
            "trace.safetensors": trace,
        },
        manifest,
    )


def n_sinks(context: Context, settings: StoreSettings) -> int:
    """Sink tokens: the prompt head and the first ``segment.sinks`` document tokens."""
    return min(len(context), context.doc_start + settings.segment.sinks)


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


def rank_stats(
    k_rank: torch.Tensor, k_raw: torch.Tensor, v_rank: torch.Tensor, v_raw: torch.Tensor
) -> dict[str, Any]:
    """Mean rank of the factorised (non-raw) spans, and the share stored raw."""

    def mean(rank: torch.Tensor, raw: torch.Tensor) -> float | None:
        return round(float(rank[~raw].float().mean()), 2) if (~raw).any() else None

    return {
        "key_rank_mean": mean(k_rank, k_raw),
        "value_rank_mean": mean(v_rank, v_raw),
        "raw_share": round(float(torch.cat([k_raw.flatten(), v_raw.flatten()]).float().mean()), 4)
        if k_raw.numel()
        else 0.0,
    }


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


def _write_atomically(
    path: Path,
    files: dict[str, dict[str, torch.Tensor]],
    manifest: dict,
    writers: dict[str, Callable[[Path], None]] | None = None,
) -> None:
    """Write ``files`` (and the files ``writers`` write to the path they get) + the manifest
    into a temporary sibling directory, then rename it to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
    try:
        manifest["files"] = {}
        for name in [*files, *(writers or {})]:
            if name in files:
                tensors = files[name]
                save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / name))
            else:
                writers[name](tmp / name)
            manifest["files"][name] = {
                "sha256": _sha256(tmp / name),
                "bytes": (tmp / name).stat().st_size,
            }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
        if path.exists():  # a stale or corrupt store being replaced
            trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
            os.replace(path, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def roles_summary(store: SpanStore) -> dict[str, int]:
    roles = store.trace["roles"]
    return {"sinks": int((roles == SINK).sum()), "anchors": int((roles == ANCHOR).sum())}


def require_store(path: Path) -> dict[str, Any]:
    """The manifest of a store directory, or an actionable error."""
    try:
        return json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        raise SekvError(f"no valid span store at {path}; run `sekv ingest` first") from None
