"""Span memory at answer time: the resident tier on the model device, and zoom-in.

:class:`SpanMemory` holds what attention reads every step (sinks' and anchors' K/V, the routing
sketch, span lengths) and hands out the zoomed spans' token-level K/V: reconstructed from the
offload tier's records (:mod:`sekv_core.zoom.reconstruct`, given the memory's :class:`RecordIndex`
and offload reader) into one pool per layer that later steps reuse (:class:`ZoomPool`, which
owns its slots). It counts the answer's reconstructions and peak zoom memory, and gives routers
a view of a subset of its spans (:class:`SpanSubset`, for the prefilter of long documents:
:mod:`sekv_core.zoom.prefilter`, given the memory's :class:`RepTables`).

Positions (RoPE). A store whose context fits the model window keeps every token at its original
position (``bounded`` False). A book's store is *bounded* (keys kept pre-RoPE, rotated at use):

    sinks                         their own positions 0 .. n_sinks - 1
    anchors                       none (a book's boundary tokens stay in their spans;
                                  a store that still holds some puts them at position 0)
    zoomed spans' tokens          packed per KV head in document order, ending at pool_end - 1
                                  (an answer's pinned passages: each in document order, the
                                  passages ordered by rank, the best one last)
    local tokens                  pool_end, pool_end + 1, ... (question/answer, or streamed chunk)

so every RoPE distance stays below ``pool_end`` + local length, whatever the document's length
(``pool_end`` and the passages' placement: the answer's :class:`~.attention.ZoomPolicy`).
A book's answer reads the same passages in every layer and head (:mod:`sekv_core.passages`).
Routers score bounded memories in the same frame (the sketch is pre-RoPE).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..kvquant import KV_BITS, Rows, row_bytes
from ..native import kernels
from ..rope import Rope
from ..sketch import column_major, is_column_major, span_token_positions
from ..store.codes import Code
from ..store.resident import ResidentTier
from .pools import KeyFrame, ZoomPool
from .prefilter import RepBlocks, RepTables
from .reconstruct import OffloadReader, RecordIndex, reconstruct


class StoreView(Protocol):
    """What the memory reads of a store: a loaded :class:`~sekv_core.store.load.SpanStore`, or a
    streamed build's store growing part by part (:class:`sekv_core.store.partial.PartialStore`):
    its manifest, resident tier, offload tier and the codes of its records."""

    manifest: dict[str, Any]
    resident: ResidentTier
    tier: OffloadReader
    codes: dict[str, Code]


class SpanMemory:
    """Device-side view of a span store for one model; shared by all questions.

    ``kv_bits``: how token-level K/V (sinks, anchors, zoomed spans) are held on the device: 8
    (int8 rows + an fp16 scale each, what answers use) or 16 (fp16: the streamed ingest attends
    to what it stores at that precision).
    """

    def __init__(
        self,
        store: StoreView,
        rope: Rope,
        device: torch.device,
        dtype: torch.dtype,
        kv_bits: int = KV_BITS,
    ) -> None:
        self.store, self.rope, self.device, self.dtype = store, rope, device, dtype
        self.kv_bits = kv_bits
        self.offload = store.tier
        positions = store.manifest.get("positions", {})
        self.bounded = positions.get("mode") == "bounded"  # pre-RoPE keys, remapped positions
        self.n_sinks = int(positions.get("sinks", 0))
        self.routed_dims: int | None = None  # sketch directions on the device (place_sketch)
        self.rep_blocks = RepBlocks()  # the prefilter's coarse index, grown with the store
        self.refresh()
        self.token_bytes = 2 * row_bytes(self.head_dim, kv_bits)  # K + V of one head-token
        self.peak_cached_bytes = 0
        self.reconstructions = 0
        self.pools: dict[int, ZoomPool] = {}  # per layer: its pool
        self.pooled_tokens = 0  # head-token slots of all pools

    def refresh(self) -> None:
        """(Re)read the resident tier from the store (a streamed build appends spans to it)."""
        r, rope, device, dtype = self.store.resident, self.rope, self.device, self.dtype
        fixed_k = r.fixed_k.to(device)  # (L, H, F, D) fp16, or 8-bit rows' codes
        if r.fixed_k_scale is not None and r.fixed_v_scale is not None:  # 8-bit rows as stored
            stored = (
                Rows(fixed_k, r.fixed_k_scale.to(device)),
                Rows(r.fixed_v.to(device), r.fixed_v_scale.to(device)),
            )
            self.fixed = tuple(
                rows if self.kv_bits == KV_BITS else Rows.encode(rows.read(dtype), self.kv_bits)
                for rows in stored
            )
        else:
            if self.bounded:  # stored pre-RoPE: sinks at their positions, anchors at 0
                pos = r.fixed_pos.to(device)
                pos = torch.where(pos < self.n_sinks, pos, torch.zeros_like(pos))
                fixed_k = rope.rotate(fixed_k.to(dtype), pos)
            # sinks + anchors at the answer's precision, (L, H, F, D) rows
            self.fixed = (
                Rows.encode(fixed_k, self.kv_bits),
                Rows.encode(r.fixed_v.to(device), self.kv_bits),
            )
        self.sketch_mean = r.sketch_mean  # (L, H, D): see sekv_core.sketch
        self.sketch_dims = r.sketch_proj.shape[-1]  # stored directions, strongest first
        dims, self.routed_dims = self.routed_dims, None  # re-placed from the (grown) store
        self.place_sketch(dims)
        self.context_len = int(self.store.manifest["document"]["context_tokens"])
        self.starts, self.ends = r.span_starts, r.span_ends  # (N,) CPU
        self.lengths = (self.ends - self.starts).to(device)
        self.log_len = self.lengths.float().log()  # (N,)
        self.n_spans = int(self.starts.numel())
        self.span_tokens = int((self.ends - self.starts).sum())  # context tokens in spans
        self.sketch_span = torch.repeat_interleave(
            torch.arange(self.n_spans), self.ends - self.starts
        ).to(device)  # (S,) span of each span token
        # (S + 1,) each span token's context position; the last entry (a free slot's -1) is
        # the context length: no token
        self.span_positions = torch.cat(
            [span_token_positions(self.starts, self.ends), torch.tensor([self.context_len])]
        ).to(device)
        # (L, H, F) context positions of the sinks and anchors
        self.fixed_positions = r.fixed_pos.long().to(device).expand(fixed_k.shape[:3]).contiguous()
        # each span's highest-surprisal sketch rows, for the prefilter of long documents
        self.span_reps = r.span_reps  # (N, 4)
        self.num_layers, self.num_kv_heads, self.fixed_tokens, self.head_dim = fixed_k.shape
        # the offload tier: each span's first row (of the sketch order, and of its records)
        lengths = self.host_lengths = self.ends - self.starts  # (N,) host
        self.first_row = torch.cumsum(lengths, 0) - lengths  # (N,) host
        self.records = self.record_index(r)

    def record_index(self, resident: ResidentTier) -> RecordIndex:
        """Where each span has its records in the offload tier (``part_rows`` (P + 1,): each
        part's first row), and the codebooks that decode them (on the host, beside the
        records)."""
        part_rows, first_row = resident.part_rows, self.first_row
        part = torch.searchsorted(part_rows, first_row, right=True) - 1
        row0 = part_rows[part]
        return RecordIndex(
            starts=self.starts,
            lengths=self.host_lengths,
            record0=self.num_layers * self.num_kv_heads * row0 + first_row - row0,
            stride=part_rows[part + 1] - row0,  # (N,) the part's rows
            num_kv_heads=self.num_kv_heads,
            context_len=self.context_len,
            codes=self.store.codes,
        )

    def place_sketch(self, dims: int | None = None) -> None:
        """Put the sketch's first ``dims`` directions (None: all) on the device for routing.

        The store keeps them strongest first with one scale per direction, so the first d of a
        store's directions are exactly a d-dimensional sketch; the rest stay on the host and are
        not resident. ``dims`` is rounded down to an even number (4-bit rows pack two per byte).
        """
        r, full = self.store.resident, self.sketch_dims
        dims = full if dims is None else max(2, min(full, dims - dims % 2))
        if dims == self.routed_dims:  # already there (answers re-place it each time)
            return
        packed = r.sketch
        cols = dims if packed.dtype == torch.int8 else dims // 2  # int8, or 4-bit pairs
        self.routed_dims = dims
        self.sketch_proj = r.sketch_proj[..., :dims].contiguous().to(self.device)
        self.sketch_scale = r.sketch_scale[..., :dims].contiguous().to(self.device)
        cut = packed[..., :cols].to(self.device)  # (L, H, S, cols)
        # a stored sketch stays column-major (store.place_resident; a view when all of it is
        # placed); a streamed build's growing rows are copied as they are
        self.sketch = column_major(cut) if is_column_major(packed) else cut.contiguous()

    def fixed_kv(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Sinks' and anchors' K, V (H, F, D) of ``layer`` in ``dtype``."""
        k, v = self.fixed
        return k.layer(layer).read(dtype), v.layer(layer).read(dtype)

    def entries(
        self, layer: int, pool_k: torch.Tensor, pool_v: torch.Tensor, pool_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What one attention call of ``layer`` reads from the memory: K, V (H, F + P, D), the
        sinks and anchors then the pool's entries ``pool_k``, ``pool_v`` (H, P, D), and the
        additive bias (H, F + P) float32: 0, then ``pool_bias``."""
        fixed_k, fixed_v = self.fixed_kv(layer, pool_k.dtype)  # (H, F, D)
        fixed_bias = pool_bias.new_zeros(fixed_k.shape[:2])
        return (
            torch.cat([fixed_k, pool_k], dim=1),
            torch.cat([fixed_v, pool_v], dim=1),
            torch.cat([fixed_bias, pool_bias], dim=1),
        )

    def pool_entries(
        self, layer: int, pool: ZoomPool, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`entries` with every slot of ``pool`` (inactive ones masked by the bias), in
        ``dtype``; 8-bit float32 rows on the CPU in one native call (the same values)."""
        fixed_k, fixed_v = (rows.layer(layer) for rows in self.fixed)
        if (
            dtype == torch.float32
            and self.kv_bits == 8
            and pool.rotated is None
            and kernels.usable(pool.bias, *fixed_k.tensors(), *fixed_v.tensors())
        ):
            return kernels.entries(fixed_k, fixed_v, pool.rows, pool.bias)
        keys, values = pool.kv(dtype)
        return self.entries(layer, keys, values, pool.bias)

    def token_positions(self, rows: torch.Tensor) -> torch.Tensor:
        """Context positions of span-token ``rows`` (any shape; -1, a free slot: the context
        length)."""
        return self.span_positions[rows]

    def resident_bytes(self) -> int:
        """Bytes of the resident tier held on the device (routing structures included). The
        offload tier's index (each part's first row) and its codebooks stay on the host beside
        it: the host reads and decodes the zoomed spans' records and sends the rows."""
        tensors = [
            *self.fixed[0].tensors(),
            *self.fixed[1].tensors(),
            self.sketch_proj,
            self.sketch_mean,
            self.sketch,
            self.sketch_scale,
            self.lengths,
            self.sketch_span,
            self.span_reps,
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- zoom-in ---------------------------------------------------------------------------

    def clear(self) -> None:
        """Drop the zoom pools and the answer's counters (between questions)."""
        self.drop_pools()
        self.peak_cached_bytes = 0
        self.reconstructions = 0

    def drop_pools(self) -> None:
        self.pools.clear()
        self.pooled_tokens = 0

    def reconstruct(
        self, layer: int, spans: torch.Tensor, heads: torch.Tensor, rotate: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-level K, V (T, D) of (span, head) pairs (``spans``, ``heads``: (n,) host) of
        one layer, flat in pair order, in the model dtype on the device
        (:func:`sekv_core.zoom.reconstruct.reconstruct`). Keys are rotated to their positions,
        except with ``rotate`` False or in a bounded memory (pre-RoPE: rotated where a pool puts
        them).
        """
        rope = self.rope if rotate and not self.bounded else None
        return reconstruct(
            self.offload,
            self.records,
            layer,
            spans,
            heads,
            rope=rope,
            dtype=self.dtype,
            device=self.device,
        )

    def zoom_pool(
        self,
        layer: int,
        zoom: torch.Tensor,
        capacity: int,
        pool_end: int | None = None,
        placement: torch.Tensor | None = None,
    ) -> ZoomPool:
        """The layer's pool updated to the picks ``zoom`` (H, N) bool.

        ``capacity``: slots per KV head of a new pool (the zoom budget: the picks never hold
        more tokens; a pool grows if they do). A bounded memory's pooled keys are rotated to
        end right before ``pool_end`` (the first local position), passage by passage by
        ``placement`` (N,) where given (:class:`~.pools.KeyFrame`). A layer whose picks did not
        change since its last call gets the same pool back. Counts the answer's reconstructions
        and peak zoom memory (see :meth:`zoom_bytes`): all pools, the new reconstructions,
        bounded memories' unrotated keys, and one call's entries in the model dtype.
        """
        pool = self.pools.get(layer)
        if pool is not None and pool.holds(zoom, pool_end):
            return pool
        if self.bounded and pool_end is None:
            raise RuntimeError("a bounded span memory needs pool_end (the first local position)")
        if pool is None:
            capacity = min(capacity, self.span_tokens)
            pool = ZoomPool.empty(zoom, capacity, self.head_dim, self.kv_bits, self.device)
            self.pools[layer] = pool
            self.pooled_tokens += pool.tokens
        frame = None
        if self.bounded:
            assert pool_end is not None
            frame = KeyFrame(self.rope, pool_end, placement, self.dtype)

        def read(spans: torch.Tensor, heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.reconstructions += int(spans.numel())
            return self.reconstruct(layer, spans, heads)

        slots = pool.tokens
        new = pool.update(zoom, pool_end, read, self.host_lengths, self.first_row, frame)
        self.pooled_tokens += pool.tokens - slots  # the pool widened if the picks needed it
        raw_keys = self.pooled_tokens // 2 if self.bounded else 0  # unrotated keys stay too
        live = (self.pooled_tokens + new + raw_keys) * self.token_bytes
        entries = self.entry_bytes(pool.owner.shape[1])
        self.peak_cached_bytes = max(self.peak_cached_bytes, live + entries)
        return pool

    @property
    def rep_tables(self) -> RepTables:
        """What the prefilter reads (:mod:`~sekv_core.zoom.prefilter`)."""
        return RepTables(
            self.sketch,
            self.sketch_proj,
            self.sketch_scale,
            self.sketch_mean,
            self.span_reps,
            self.lengths,
        )

    def subset(self, layer: int, index: torch.Tensor) -> SpanSubset:
        """Spans ``index`` (K,) of ``layer`` as a router reads them (:class:`SpanSubset`)."""
        return SpanSubset(self, layer, index)

    def entry_bytes(self, pooled: int) -> int:
        """The memory entries one attention call reads in the model dtype (sinks and anchors,
        ``pooled`` zoomed tokens per KV head): K and V."""
        entries = self.fixed_tokens + pooled
        return self.num_kv_heads * 2 * entries * self.head_dim * self.dtype.itemsize

    def zoom_bytes(self, tokens: int) -> int:
        """Peak bytes an answer's zoom takes when every layer's pool holds ``tokens`` per KV head,
        at most: what :meth:`zoom_pool` counts at its worst (all pools, one
        layer's pool of new reconstructions, bounded memories' unrotated keys, one call's
        entries in the model dtype) and one layer's pool more for the new reconstructions as
        read, before they are encoded. Memory targets turn into zoom budgets with it."""
        held = self.num_layers * (1.5 if self.bounded else 1.0) + 2
        return int(self.num_kv_heads * tokens * held * self.token_bytes) + self.entry_bytes(tokens)


class _OneLayer:
    """A per-layer tensor of a :class:`SpanSubset`: indexable by its layer only."""

    def __init__(self, layer: int, tensor: torch.Tensor) -> None:
        self.layer, self.tensor = layer, tensor

    def __getitem__(self, layer: int) -> torch.Tensor:
        if layer != self.layer:
            raise IndexError(f"subset of layer {self.layer} read at layer {layer}")
        return self.tensor


class SpanSubset:
    """Spans ``index`` (K,) of a :class:`SpanMemory` at one layer, as a router reads them.

    Span ids are local (0..K-1); the caller maps the scores back with ``index``. ``rows``
    (S_k,): the sketch rows of the subset's tokens.
    """

    def __init__(self, memory: SpanMemory, layer: int, index: torch.Tensor) -> None:
        self.memory, self.index = memory, index
        self.num_layers, self.num_kv_heads = memory.num_layers, memory.num_kv_heads
        self.head_dim, self.bounded = memory.head_dim, memory.bounded
        self.n_spans = int(index.numel())
        self.lengths, self.log_len = memory.lengths[index], memory.log_len[index]
        first = torch.cumsum(memory.lengths, 0) - memory.lengths  # (N,) first sketch row
        device = index.device
        local = torch.repeat_interleave(torch.arange(self.n_spans, device=device), self.lengths)
        within = (
            torch.arange(local.numel(), device=device)
            - (torch.cumsum(self.lengths, 0) - self.lengths)[local]
        )
        self.rows = first[index][local] + within  # (S_k,) sketch rows of the subset's tokens
        self.sketch_span = local
        self.sketch_proj, self.sketch_scale = memory.sketch_proj, memory.sketch_scale
        self.sketch_mean = memory.sketch_mean
        self.sketch = _OneLayer(layer, memory.sketch[layer][:, self.rows])
        self.layer = layer
