"""The offload tier on disk, entropy-coded: the same records in fewer bytes, decoded at load.

A record of an offload code (:mod:`sekv_core.store.codes`) holds fixed-width fields
(``record_fields``: a key's direction codes; a value's tier codes and scale bytes), and a
field's codes crowd the centre of its range. So the file holds, per (layer, KV head, field), a
*stream* of that field over every span token's row, coded with a static rANS coder (``rans.c``)
under a discretised Gaussian table fitted to it (two fp16 numbers: centre and spread, the
spread picked from :data:`SPREADS` times the stream's deviation by the length it codes to).
Every symbol keeps a probability of at least 2^-12, so a stream always codes. Each layer's
streams are one coding of their own, so layers decode in parallel.

Lossless: loading decodes the records bit for bit (:func:`expanded`). The build decodes what
it wrote and keeps a kind's records as they are where that fails, where the coding would not
be smaller, or where the native library is missing (:func:`compacted`). The tables are rebuilt
at load from the stored numbers and checked against the build's checksum of them, so a machine
that rounds one differently refuses the store rather than decode it wrongly.
"""

from __future__ import annotations

import ctypes
import hashlib

import numpy as np
import torch

from ..native import library
from ..threads import each_on_threads

PROB_BITS = 12  # a table's probabilities are multiples of 2^-PROB_BITS
TABLE = 256  # entries per stream's table: the widest field (8 bits)
SPREADS = (0.6, 0.75, 0.9, 1.0, 1.15, 1.35)  # tried multiples of a stream's deviation
KINDS = ("k", "v")
PARAMS = np.float16  # a stream's table's two numbers, as stored (tables are built from them)
CODED = ("coded", "coded_bytes", "params", "check")  # a coded kind's tensors, ``{kind}_{name}``


def usable() -> bool:
    """Whether this machine can code and decode tiers (the native library is built)."""
    return library() is not None


def compacted(records: dict[str, torch.Tensor], codes: dict) -> dict[str, torch.Tensor]:
    """The offload file's tensors for each kind's records (``records[kind]``: (L, H, S, B) uint8,
    contiguous, a layer's rows in order) in ``codes`` (kind -> code): the kind's coding
    (:data:`CODED`), or its records as they are (``{kind}_rows``, flat: a view) where the coding
    does not pay or fails."""
    out = {}
    for kind in KINDS:
        rows = records[kind]
        coded = _compact_kind(rows, codes[kind]) if usable() and rows.numel() else None
        size = sum(t.numel() * t.element_size() for t in coded.values()) if coded else None
        if size is None or size >= rows.numel():
            out[f"{kind}_rows"] = rows.view(-1)
        else:
            out.update({f"{kind}_{name}": t for name, t in coded.items()})
    return out


def expanded(tensors: dict[str, torch.Tensor], rows: int, codes: dict) -> dict[str, torch.Tensor]:
    """The flat fixed-rate records (``k_rows``, ``v_rows``: (L, H, ``rows``, B)) of an offload
    file's tensors: decoded where coded, else as stored. ValueError where a coding does not
    decode (or this machine cannot decode it)."""
    out = {}
    for kind in KINDS:
        if f"{kind}_rows" in tensors:
            L, H = codes[kind].basis.shape[:2]
            if tensors[f"{kind}_rows"].numel() != L * H * rows * codes[kind].record_bytes:
                raise ValueError(f"its {kind} records are not those of its spans")
            out[f"{kind}_rows"] = tensors[f"{kind}_rows"]
            continue
        if not usable():
            raise ValueError("its offload tier is entropy-coded and the native library is missing")
        got = {name: tensors[f"{kind}_{name}"] for name in CODED}
        out[f"{kind}_rows"] = _expand_kind(got, rows, codes[kind])
    return out


def _compact_kind(records: torch.Tensor, code) -> dict | None:
    """Each layer coded alone (its streams under fresh coder states), so layers decode in
    parallel; one table per stream over all rows. The layers' codings are placed one after
    another in one buffer of the records' size (its pages past the coding are never touched)."""
    widths, flips = code.record_fields()
    B = code.record_bytes
    if int(widths.sum(dim=1).max()) != 8 * B or int(widths.sum(dim=1).min()) != 8 * B:
        return None  # fields that do not cover the record: not this coder's
    L, H = records.shape[:2]
    streams = H * widths.shape[1]  # a layer's
    params = _fit(_histogram(records, widths, flips), widths, H)
    tables = _tables(params, widths, H)
    coded = torch.empty(records.numel(), dtype=torch.uint8)
    lengths, end = [], 0
    for at in range(L):
        layer, fields = records[at : at + 1], (widths[at : at + 1], flips[at : at + 1])
        table = tables[at * streams : (at + 1) * streams]
        piece = _encode(layer, *fields, table)
        if piece is None or end + piece.numel() > coded.numel():  # not smaller
            return None
        if not torch.equal(_decode(piece, torch.empty_like(layer), *fields, table), layer):
            return None  # never written: a coding that does not give the records back
        coded[end : end + piece.numel()] = piece
        end += piece.numel()
        lengths.append(piece.numel())
    return {
        "coded": coded[:end],
        "coded_bytes": torch.tensor(lengths, dtype=torch.int64),
        "params": torch.from_numpy(params),
        "check": _checksum(tables),
    }


def _expand_kind(got: dict, rows: int, code) -> torch.Tensor:
    widths, flips = code.record_fields()
    L, H, B = widths.shape[0], code.basis.shape[1], code.record_bytes
    streams = H * widths.shape[1]  # a layer's
    lengths = got["coded_bytes"].tolist()
    params = got["params"]
    if len(lengths) != L or params.shape != (streams * L, 2):
        raise ValueError("its offload coding does not match its layers")
    tables = _tables(params.float().numpy(), widths, H)
    if not torch.equal(_checksum(tables), got["check"]):
        raise ValueError("its offload coding's tables differ on this machine")
    if sum(lengths) != got["coded"].numel():
        raise ValueError("its offload coding's layers do not add up to its bytes")
    out = torch.empty(L, H, rows, B, dtype=torch.uint8)
    at = np.cumsum([0, *lengths])

    def layer(i: int) -> None:  # each layer's bytes decode alone, into its place
        coded = got["coded"][at[i] : at[i + 1]]
        fields = (widths[i : i + 1], flips[i : i + 1])
        _decode(coded, out[i : i + 1], *fields, tables[i * streams : (i + 1) * streams])

    each_on_threads(layer, range(L))
    return out.view(-1)


def _stream_widths(widths: torch.Tensor, H: int) -> np.ndarray:
    """(L * H * F,) each stream's field width, in stream order."""
    return widths[:, None].expand(-1, H, -1).reshape(-1).numpy()


def _histogram(records: torch.Tensor, widths: torch.Tensor, flips: torch.Tensor) -> np.ndarray:
    L, H, S, B = records.shape
    counts = torch.empty(L * H * widths.shape[1], TABLE, dtype=torch.int64)
    records = records.contiguous()
    rc = library().sekv_rans_histogram(
        _ptr(records), L, H, S, B, widths.shape[1], _ptr(widths), _ptr(flips), _ptr(counts)
    )
    if rc:
        raise ValueError("record fields do not fit the records")
    return counts.numpy()


def _fit(counts: np.ndarray, widths: torch.Tensor, H: int) -> np.ndarray:
    """(N, 2) :data:`PARAMS` each stream's centre and spread: the stream's mean, and the multiple of
    its deviation in :data:`SPREADS` whose table codes its histogram shortest (the first such)."""
    k = np.arange(TABLE, dtype=np.float64)
    total = np.maximum(counts.sum(axis=1), 1)
    mean = (counts * k).sum(axis=1) / total
    dev = np.sqrt((counts * (k - mean[:, None]) ** 2).sum(axis=1) / total)
    dev = np.maximum(dev, 0.25)
    spreads = np.array(SPREADS)
    best = np.zeros((counts.shape[0], 2), dtype=PARAMS)
    stream_widths = _stream_widths(widths, H)
    for width in np.unique(stream_widths).tolist():
        at, n = np.flatnonzero(stream_widths == width), 2**width
        centres = np.broadcast_to(mean[at, None], (at.size, spreads.size))
        trials = np.stack([centres, dev[at, None] * spreads], axis=-1).astype(PARAMS)  # as stored
        freq = _width_tables(trials.reshape(-1, 2), n).reshape(at.size, spreads.size, n)
        cost = -(counts[at, None, :n] * np.log2(freq / 2**PROB_BITS)).sum(axis=-1)
        best[at] = trials[np.arange(at.size), cost.argmin(axis=1)]
    return best


def _tables(params: np.ndarray, widths: torch.Tensor, H: int) -> np.ndarray:
    """(N, TABLE) uint16 every stream's table of its (centre, spread) (:func:`_width_tables`);
    a stream's entries past its 2^width are 0."""
    stream_widths = _stream_widths(widths, H)
    out = np.zeros((stream_widths.size, TABLE), dtype=np.uint16)
    for width in np.unique(stream_widths).tolist():
        at = np.flatnonzero(stream_widths == width)
        out[at, : 2**width] = _width_tables(params[at], 2**width)
    return out


def _width_tables(params: np.ndarray, n: int) -> np.ndarray:
    """(M, n) int64 the tables of M streams of n symbols from their (centre, spread) (M, 2):
    each symbol 1 + its share of the rest of 2^PROB_BITS under a discretised Gaussian (rounded
    down), the remainder on the likeliest symbol."""
    k = np.arange(n, dtype=np.float64)
    centre, spread = (params[:, i : i + 1].astype(np.float64) for i in (0, 1))
    z = (k - centre) / spread
    logp = -0.5 * z * z
    p = np.exp(logp - logp.max(axis=1, keepdims=True))
    share = p / p.sum(axis=1, keepdims=True)
    freq = 1 + np.floor(share * (2**PROB_BITS - n)).astype(np.int64)
    freq[np.arange(len(params)), p.argmax(axis=1)] += 2**PROB_BITS - freq.sum(axis=1)
    return freq


def _checksum(tables: np.ndarray) -> torch.Tensor:
    """sha256 (32,) uint8 of every stream's table, as this machine builds them."""
    digest = hashlib.sha256(np.ascontiguousarray(tables).tobytes()).digest()
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


def _encode(
    records: torch.Tensor, widths: torch.Tensor, flips: torch.Tensor, freq: np.ndarray
) -> torch.Tensor | None:
    L, H, S, B = records.shape
    cap = records.numel() + 64  # a coding past the records' own size is not kept anyway
    out = torch.empty(cap, dtype=torch.uint8)
    table = torch.from_numpy(np.ascontiguousarray(freq))
    records = records.contiguous()
    n = library().sekv_rans_encode(
        _ptr(records),
        L,
        H,
        S,
        B,
        widths.shape[1],
        _ptr(widths),
        _ptr(flips),
        _ptr(table),
        _ptr(out),
        cap,
    )
    return None if n < 0 else out[cap - n :].clone()


def _decode(
    coded: torch.Tensor, out: torch.Tensor, widths: torch.Tensor, flips: torch.Tensor, freq
) -> torch.Tensor:
    """Decode ``coded`` into the records ``out`` (L, H, S, B) uint8, contiguous."""
    L, H, S, B = out.shape
    table = torch.from_numpy(np.ascontiguousarray(freq))
    coded = coded.contiguous()
    rc = library().sekv_rans_decode(
        _ptr(coded),
        coded.numel(),
        L,
        H,
        S,
        B,
        widths.shape[1],
        _ptr(widths),
        _ptr(flips),
        _ptr(table),
        _ptr(out),
    )
    if rc:
        raise ValueError("its offload coding does not decode (corrupt)")
    return out


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())
