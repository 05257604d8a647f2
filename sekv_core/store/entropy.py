"""The offload tier on disk, entropy-coded in blocks: the same records in fewer bytes, each
block decoded when an answer first reads it.

A record of an offload code (:mod:`sekv_core.store.codes`) holds fixed-width fields
(``record_fields``), and a field's codes crowd the centre of its range. So each (layer, KV head,
field) has a table: a discretised Gaussian (centre and spread, two fp16 numbers, the spread the
multiple of the field's deviation in :data:`SPREADS` that codes shortest). A (layer, head)'s rows
are cut into blocks of :data:`BLOCK_ROWS`, each coded alone by a static rANS coder
(``native/rans.c``; every byte: ``docs/store-format.md``): an answer decodes the blocks its zooms
touch (:class:`OffloadTier`), not the tier. Lossless, or not used (:func:`compacted`); a load
checks the tables it rebuilds against the build's checksum, so a machine that rounds one
differently refuses the store rather than decode it wrongly.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..native.build import library
from ..threads import each_on_threads

PROB_BITS = 12  # a table's probabilities are multiples of 2^-PROB_BITS
TABLE = 256  # entries per stream's table: the widest field (8 bits)
SPREADS = (0.6, 0.75, 0.9, 1.0, 1.15, 1.35)  # tried multiples of a stream's deviation
BLOCK_ROWS = 64  # a (layer, head)'s rows coded alone: the least a zoom decodes
STATE_BYTES = 16  # a block's coding opens with its four coder states
KINDS = ("k", "v")
PARAMS = np.float16  # a stream's table's two numbers, as stored (tables are built from them)
CODED = ("coded", "block_bytes", "params", "check")  # a coded kind's tensors, ``{kind}_{name}``


def usable() -> bool:
    """Whether this machine can code and decode tiers (the native library is built)."""
    return library() is not None


def blocks_of(rows: int) -> int:
    """Blocks of a (layer, head)'s ``rows`` rows (the last holds the rest)."""
    return -(-rows // BLOCK_ROWS)


def compacted(records: dict[str, torch.Tensor], codes: dict) -> dict[str, torch.Tensor]:
    """The offload file's tensors for each kind's records (``records[kind]``: (L, H, S, B) uint8,
    contiguous, a layer's rows in order) in ``codes`` (kind -> code): the kind's coding
    (:data:`CODED`), or its records as they are (``{kind}_rows``, flat: a view) where the coding
    would not be smaller, does not decode back to them, or the native library is missing."""
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


class OffloadTier:
    """The offload tier's fixed-rate records as answers read them: ``buffers`` by name
    (``k_rows``, ``v_rows``: flat (L, H, rows, B) uint8). A kind stored as records is its file's
    tensor; a coded kind's buffer is filled block by block as reads ask for it (:meth:`fill`),
    so host memory holds the blocks answers touched. ValueError where a coding does not fit its
    records (or this machine cannot decode it)."""

    def __init__(self, tensors: dict[str, torch.Tensor], rows: int, codes: dict) -> None:
        self.rows, self.buffers = rows, {}
        self._coded: dict[str, Coding] = {}  # the kinds not decoded whole
        self._done: dict[str, np.ndarray] = {}  # kind -> (L * H * blocks,) bool
        self._lock = threading.Lock()  # one decode at a time: a block is written once
        for kind in KINDS:
            L, H = codes[kind].basis.shape[:2]
            B = codes[kind].record_bytes
            if f"{kind}_rows" in tensors:
                if tensors[f"{kind}_rows"].numel() != L * H * rows * B:
                    raise ValueError(f"its {kind} records are not those of its spans")
                self.buffers[f"{kind}_rows"] = tensors[f"{kind}_rows"]
                continue
            if not usable():
                raise ValueError(
                    "its offload tier is entropy-coded and the native library is missing"
                )
            got = {name: tensors[f"{kind}_{name}"] for name in CODED}
            self._coded[kind] = _coding(got, L, H, rows, codes[kind])
            self._done[kind] = np.zeros(got["block_bytes"].numel(), dtype=bool)
            self.buffers[f"{kind}_rows"] = torch.empty(L * H * rows * B, dtype=torch.uint8)

    @property
    def nbytes(self) -> int:
        """Bytes of the records decoded whole."""
        return sum(t.numel() for t in self.buffers.values())

    @property
    def decoded_bytes(self) -> int:
        """Bytes of the records in host memory now: the kinds stored as records, and the
        blocks decoded so far (a loaded store's coding stays in its file, memory-mapped)."""
        nb = blocks_of(self.rows)
        out = 0
        for kind in KINDS:
            size = self.buffers[f"{kind}_rows"].numel()
            if kind not in self._done:
                out += size
                continue
            blocks = np.flatnonzero(self._done[kind]) % nb
            rows = np.minimum(self.rows - blocks * BLOCK_ROWS, BLOCK_ROWS).sum()
            out += int(rows) * self._coded[kind].shape[3]
        return out

    def fill(self, first: torch.Tensor, counts: torch.Tensor) -> None:
        """Decode every block that holds one of the records ``[first[i], first[i] + counts[i])``
        (host int64 record numbers, a range within one (layer, head)) of each kind. Called at
        every zoom of every layer: in numpy, and a range's first and last block only where no
        range spans more than two (a span's rows, every range of a decode step)."""
        if not self._coded:
            return
        nb, first, counts = blocks_of(self.rows), first.numpy(), counts.numpy()
        keep = counts > 0
        first, counts = first[keep], counts[keep]
        lh, at = first // self.rows, first % self.rows
        lo = lh * nb + at // BLOCK_ROWS
        hi = lh * nb + (at + counts - 1) // BLOCK_ROWS
        if (hi - lo <= 1).all():
            ids = np.concatenate([lo, hi])
        else:
            n = hi - lo + 1
            ids = np.repeat(lo - np.cumsum(n) + n, n) + np.arange(n.sum())
        self._decode(ids)

    def offload_records(self, name: str, size: int, ranges: Any) -> torch.Tensor:
        """Records (len(ranges.index), size) of buffer ``name`` at ``ranges.index`` (record
        numbers), as they are (:meth:`fill` decodes them first)."""
        return self.buffers[name].view(-1, size).index_select(0, ranges.index)

    def whole(self, kinds: tuple[str, ...] = KINDS) -> dict[str, torch.Tensor]:
        """The buffers with every block of ``kinds`` decoded (layers on threads)."""
        with self._lock:
            for kind in [k for k in kinds if k in self._done]:
                coding, done = self._coded[kind], self._done[kind]
                out, L = self.buffers[f"{kind}_rows"], coding.shape[0]
                blocks = np.arange(done.size).reshape(L, -1)

                def layer(i: int, coding=coding, out=out, blocks=blocks, done=done) -> None:
                    todo = blocks[i][~done[blocks[i]]]
                    if todo.size:
                        coding.decode(torch.from_numpy(todo), out)

                each_on_threads(layer, range(L))
                self._release(kind)
        return self.buffers

    def _decode(self, ids: np.ndarray) -> None:
        with self._lock:
            for kind in list(self._done):
                done = self._done[kind]
                todo = ids[~done[ids]]
                if todo.size:
                    todo = np.unique(todo)  # ascending, once each
                    self._coded[kind].decode(torch.from_numpy(todo), self.buffers[f"{kind}_rows"])
                    done[todo] = True
                    if done.all():
                        self._release(kind)

    def _release(self, kind: str) -> None:
        """A kind decoded whole: its coding let go (its buffer is its records now)."""
        del self._coded[kind], self._done[kind]


def _compact_kind(records: torch.Tensor, code) -> dict | None:
    """Every block of every layer coded alone (:data:`BLOCK_ROWS` rows of a (layer, head)), one
    table per (layer, head, field) over all its rows. The codings are placed one after another in
    one buffer of the records' size (its pages past the coding are never touched); each layer's
    is decoded back and compared before it is kept."""
    widths, B = code.record_fields(), code.record_bytes  # fields that cover each record
    L, H, S = records.shape[:3]
    streams = H * widths.shape[1]  # a layer's
    params = _fit(_histogram(records, widths), widths, H)
    tables = _tables(params, widths, H)
    coded = torch.empty(records.numel(), dtype=torch.uint8)
    lengths, end = [], 0
    for at in range(L):
        layer, fields = records[at : at + 1], widths[at : at + 1]
        table = np.ascontiguousarray(tables[at * streams : (at + 1) * streams])
        got = _encode_blocks(layer, fields, table, coded[end:])
        if got is None:  # not smaller
            return None
        piece, sizes = got
        coding = Coding(piece, _starts(sizes), (1, H, S, B), fields, torch.from_numpy(table))
        out = torch.empty_like(layer).view(-1)
        try:
            coding.decode(torch.arange(sizes.numel()), out)
        except ValueError:
            return None
        if not torch.equal(out, layer.reshape(-1)):
            return None  # never written: a coding that does not give the records back
        end += piece.numel()
        lengths.append(sizes)
    return {
        "coded": coded[:end],
        "block_bytes": torch.cat(lengths),
        "params": torch.from_numpy(params),
        "check": _checksum(tables),
    }


@dataclass(frozen=True)
class Coding:
    """A coded kind as decoding reads it: its bytes and each block's first byte (``starts``, the
    end last), the records' shape (L, H, S rows, B bytes), the fields and the tables."""

    coded: torch.Tensor
    starts: torch.Tensor
    shape: tuple[int, int, int, int]
    widths: torch.Tensor
    tables: torch.Tensor

    def decode(self, blocks: torch.Tensor, out: torch.Tensor) -> None:
        """Decode the blocks ``blocks`` (ascending int64) into their rows of ``out`` (flat
        (L, H, S, B) uint8); ValueError where they are not a coding."""
        rc = library().sekv_rans_decode_blocks(
            _ptr(self.coded),
            _ptr(self.starts),
            *self.shape,
            self.widths.shape[1],
            _ptr(self.widths),
            _ptr(self.tables),
            BLOCK_ROWS,
            _ptr(blocks),
            blocks.numel(),
            _ptr(out),
        )
        if rc:
            raise ValueError("its offload coding does not decode (corrupt)")


def _coding(got: dict, L: int, H: int, rows: int, code) -> Coding:
    """A coded kind's tensors as decoding reads them, its tables rebuilt and checked."""
    widths = code.record_fields()
    streams = H * widths.shape[1]  # a layer's
    sizes, params = got["block_bytes"], got["params"]
    if (
        widths.shape[0] != L
        or sizes.dtype != torch.int64
        or sizes.shape != (L * H * blocks_of(rows),)
        or params.shape != (streams * L, 2)
    ):
        raise ValueError("its offload coding does not match its layers")
    tables = _tables(params.float().numpy(), widths, H)
    if not torch.equal(_checksum(tables), got["check"]):
        raise ValueError("its offload coding's tables differ on this machine")
    if bool((sizes < STATE_BYTES).any()) or int(sizes.sum()) != got["coded"].numel():
        raise ValueError("its offload coding's blocks do not add up to its bytes")
    table = torch.from_numpy(np.ascontiguousarray(tables))
    shape = (L, H, rows, code.record_bytes)
    return Coding(got["coded"].contiguous(), _starts(sizes), shape, widths, table)


def _starts(sizes: torch.Tensor) -> torch.Tensor:
    """(n + 1,) int64 each block's first byte, and the end."""
    return torch.cat([sizes.new_zeros(1), torch.cumsum(sizes, 0)])


def _stream_widths(widths: torch.Tensor, H: int) -> np.ndarray:
    """(L * H * F,) each stream's field width, in stream order."""
    return widths[:, None].expand(-1, H, -1).reshape(-1).numpy()


def _histogram(records: torch.Tensor, widths: torch.Tensor) -> np.ndarray:
    L, H, S, B = records.shape
    counts = torch.empty(L * H * widths.shape[1], TABLE, dtype=torch.int64)
    records = records.contiguous()
    rc = library().sekv_rans_histogram(
        _ptr(records), L, H, S, B, widths.shape[1], _ptr(widths), _ptr(counts)
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


def _encode_blocks(
    records: torch.Tensor, widths: torch.Tensor, freq: np.ndarray, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The blocks of ``records`` (L, H, S, B) coded into the front of ``out`` (uint8): that part
    of ``out`` and each block's bytes (L * H * blocks,) int64; None where they do not fit."""
    L, H, S, B = records.shape
    lengths = torch.empty(L * H * blocks_of(S), dtype=torch.int64)
    table = torch.from_numpy(np.ascontiguousarray(freq))
    records = records.contiguous()
    n = library().sekv_rans_encode_blocks(
        _ptr(records),
        L,
        H,
        S,
        B,
        widths.shape[1],
        _ptr(widths),
        _ptr(table),
        BLOCK_ROWS,
        _ptr(out),
        out.numel(),
        _ptr(lengths),
    )
    return None if n < 0 else (out[:n], lengths)


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())
