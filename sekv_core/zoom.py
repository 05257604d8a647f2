"""Span memory at answer time: the resident tier on the model device, zoom-in reconstructions.

:class:`SpanMemory` holds what attention reads every step (sinks + anchors K/V, span summaries,
routing sketch) and reconstructs token-level K/V of spans from the offloaded bases on demand,
batched over heads and spans, into one pool per layer that later steps reuse (a changed pick
rebuilds only the new spans: decoding does not reconstruct what the layer already holds).
:class:`ZoomTrace` records which spans were zoomed, where, and why (score vs threshold).

Positions (RoPE). A store whose context fits the model window keeps every token at its original
position (``bounded`` False). A book's store is *bounded* (keys kept pre-RoPE, rotated at use):

    sinks                         their own positions 0 .. n_sinks - 1
    anchors, span summaries       position 0 (one fixed place, InfLLM style)
    zoomed spans' tokens          packed per KV head in document order, ending at pool_end - 1
    local tokens                  pool_end, pool_end + 1, ... (question/answer, or streamed chunk)

so every RoPE distance stays below ``pool_end`` + local length, whatever the document's length.
Routers score bounded memories in the same frame: pre-RoPE sketch, summaries at position 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .kvquant import Rows, row_bytes
from .near import near_count
from .rope import Rope, rotate_half
from .sketch import sketch_logits
from .store import SpanStore, padded_blocks

# token-level K/V on the device (zoomed spans' reconstructions, sinks, anchors) as int8 rows with
# one fp16 scale each (sekv_core.kvquant): ~1.9x the zoomed tokens per byte of fp16; measured on
# the default model, answers follow full KV's as closely (see docs/benchmarks.md, sixth pass)
KV_BITS = 8
# above this many spans (books of ~60K tokens), routers only score the spans whose representative
# tokens score among the best ``keep`` (or 4x the budget's worth of spans) per KV head
PREFILTER_SPANS = 2048
PREFILTER_KEEP = 256
ABSENT = torch.iinfo(torch.int32).max  # a pool slot's token id on padding (ids are int32)


class SpanMemory:
    """Device-side view of a span store for one model; shared by all questions."""

    def __init__(
        self,
        store: SpanStore,
        rope: Rope,
        device: torch.device,
        dtype: torch.dtype,
        kv_bits: int = KV_BITS,
    ) -> None:
        self.store, self.rope, self.device, self.dtype = store, rope, device, dtype
        # token-level K/V on the device (sinks, anchors, zoomed spans): 8: int8 rows + fp16
        # scales; 16: fp16 (CACHE_DTYPE)
        self.kv_bits = kv_bits
        positions = store.manifest.get("positions", {})
        self.bounded = positions.get("mode") == "bounded"  # pre-RoPE keys, remapped positions
        self.n_sinks = int(positions.get("sinks", 0))
        self.pool_end: int | None = None  # bounded: the first local position (set per answer)
        self.routed_dims: int | None = None  # sketch directions on the device (place_sketch)
        self.refresh()
        self.token_bytes = 2 * row_bytes(self.head_dim, kv_bits)  # K + V of one head-token
        self.peak_cached_bytes = 0
        self.reconstructions = 0
        # optional rank gate (trained): (kind, layer, heads (n,), spectra (n, r)) -> ranks (n,)
        self.rank_gate: Callable[[str, int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.rank_sum = {"k": 0, "v": 0}  # ranks used by factorised reconstructions
        self.rank_count = {"k": 0, "v": 0}
        # per layer: the last pool built, with the picks it was built for
        self._pools: dict[int, ZoomPool] = {}

    def refresh(self) -> None:
        """(Re)read the resident tier from the store (a streamed build appends spans to it)."""
        r, rope, device, dtype = self.store.resident, self.rope, self.device, self.dtype
        fixed_k = r["fixed_k"].to(device)  # (L, H, F, D); the store keeps fp16 on the host
        # span summaries (L, H, N, D) stay on the host until an answer reads them (see summary_k)
        self._summaries = {"k": r["summary_k"], "v": r["summary_v"]}
        self._device_summaries: dict[str, torch.Tensor] = {}
        if self.bounded:  # stored pre-RoPE: sinks at their positions, anchors/summaries at 0
            pos = r["fixed_pos"].to(device)
            pos = torch.where(pos < self.n_sinks, pos, torch.zeros_like(pos))
            fixed_k = rope.rotate(fixed_k.to(dtype), pos)
        # sinks + anchors at the answer's precision, (L, H, F, D) rows
        self.fixed = (
            Rows.encode(fixed_k, self.kv_bits),
            Rows.encode(r["fixed_v"].to(device), self.kv_bits),
        )
        self.sketch_mean = r["sketch_mean"]  # (L, H, D): see sekv_core.sketch
        self.sketch_dims = r["sketch_proj"].shape[-1]  # stored directions, strongest first
        dims, self.routed_dims = self.routed_dims, None  # re-placed from the (grown) store
        self.place_sketch(dims)
        self.starts, self.ends = r["span_starts"], r["span_ends"]  # (N,) CPU
        self.lengths = (self.ends - self.starts).to(device)
        self.log_len = self.lengths.float().log()  # (N,)
        self.n_spans = int(self.starts.numel())
        self.span_tokens = int((self.ends - self.starts).sum())  # context tokens in spans
        self.sketch_span = torch.repeat_interleave(
            torch.arange(self.n_spans), self.ends - self.starts
        ).to(device)  # (S,) span of each span token
        # each span's highest-surprisal sketch rows, for the prefilter of long documents
        self.span_reps = r.get("span_reps")  # (N, 4)
        self.num_layers, self.num_kv_heads, self.fixed_tokens, self.head_dim = fixed_k.shape
        # reconstructed pre-RoPE keys are rotated to their positions at use (no resident tables)
        self.context_len = int(self.store.manifest["document"]["context_tokens"])
        self.tables = {k: v for k, v in r.items() if k.startswith(("k_", "v_"))}
        self._oracle_keys: dict[int, torch.Tensor] = {}

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
        packed = r["sketch"]
        cols = dims if packed.dtype == torch.int8 else dims // 2  # int8, or 4-bit pairs
        self.routed_dims = dims
        self.sketch_proj = r["sketch_proj"][..., :dims].contiguous().to(self.device)
        self.sketch_scale = r["sketch_scale"][..., :dims].contiguous().to(self.device)
        self.sketch = packed[..., :cols].contiguous().to(self.device)  # (L, H, S, cols)

    @property
    def summary_k(self) -> torch.Tensor:
        """Span summary keys (L, H, N, D) on the device; placed there on first use (the
        training-free sketch routing never reads them, so they are not resident then)."""
        return self._summary("k")

    @property
    def summary_v(self) -> torch.Tensor:
        """Span summary values (L, H, N, D) on the device (only attention over summaries reads
        them); placed there on first use."""
        return self._summary("v")

    @property
    def n_summaries(self) -> int:
        """Spans with a summary (fewer than ``n_spans`` while a book is being streamed)."""
        return int(self._summaries["k"].shape[2])

    def place_summaries(self, values: bool) -> None:
        """Put the summary keys (and ``values``) on the device now (they count as resident)."""
        self._summary("k")
        if values:
            self._summary("v")

    def _summary(self, kind: str) -> torch.Tensor:
        if kind not in self._device_summaries:
            t = self._summaries[kind].to(self.device)
            if kind == "k" and self.bounded:  # pre-RoPE on disk: rotated to position 0
                zero = torch.zeros(t.shape[2], dtype=torch.long)
                t = self.rope.rotate(t.to(self.dtype), zero).to(t.dtype)
            self._device_summaries[kind] = t
        return self._device_summaries[kind]

    def span_values(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        """Mean values (H, M, D) of spans ``index`` (H, M) of ``layer``, each KV head its own,
        gathered for one attention call from the summaries (held on the host unless an answer
        placed them): the near spans' values (:mod:`sekv_core.near`), counted in the answer's
        peak beside the zoom pools."""
        placed = self._device_summaries.get("v")
        source = placed[layer] if placed is not None else self._summaries["v"][layer]
        at = index.to(source.device)[..., None].expand(-1, -1, source.shape[-1])
        out = source.gather(1, at).to(self.device)
        pools = sum(pool.tokens for pool in self._pools.values()) * self.token_bytes
        pooled = self._pools[layer].owner.shape[1] if layer in self._pools else 0
        live = pools + self._entry_bytes(pooled, False, near=index.shape[1])
        self.peak_cached_bytes = max(self.peak_cached_bytes, live)
        return out

    def fixed_kv(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Sinks' and anchors' K, V (H, F, D) of ``layer`` in ``dtype``."""
        k, v = self.fixed
        return k.layer(layer).read(dtype), v.layer(layer).read(dtype)

    def resident_bytes(self) -> int:
        """Bytes of the resident tier held on the device (routing structures included; span
        summaries only once something has read them). The offload tier's index (per-span
        ranks and offsets, ``tables``) stays on the host beside it: the host gathers the factors."""
        tensors = [
            *self.fixed[0].tensors(),
            *self.fixed[1].tensors(),
            *self._device_summaries.values(),
            self.sketch_proj,
            self.sketch_mean,
            self.sketch,
            self.sketch_scale,
            self.lengths,
            self.sketch_span,
            *([] if self.span_reps is None else [self.span_reps]),
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    def clear(self) -> None:
        """Drop the zoom pools and the answer's counters (between questions)."""
        self._pools.clear()
        self.peak_cached_bytes = 0
        self.reconstructions = 0
        self.rank_sum, self.rank_count = {"k": 0, "v": 0}, {"k": 0, "v": 0}

    def reconstruct(
        self, layer: int, spans: torch.Tensor, heads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-level K, V of (span, head) pairs (``spans``, ``heads``: (n,) host tensors) of
        one layer, flat in pair order: (T, D) each in the model dtype, T the pairs' total length.

        Keys are rotated to their positions (bounded memories: kept pre-RoPE, rotated where the
        pool places them). All pairs' factors are read from the offload tier at once per
        tensor kind (raw spans: their rows as stored; factorised ones: one batched product).
        """
        lengths = self.ends[spans] - self.starts[spans]  # (n,)
        pair = torch.repeat_interleave(torch.arange(spans.numel()), lengths)  # (T,) host
        keys = self._rows("k", layer, spans, heads, lengths, pair)  # pre-RoPE
        if not self.bounded:
            within = torch.arange(pair.numel()) - (torch.cumsum(lengths, 0) - lengths)[pair]
            pos = (self.starts[spans][pair] + within).clamp(max=self.context_len - 1)
            cos, sin = self.rope.tables(pos, keys)
            keys = keys * cos + rotate_half(keys) * sin
        values = self._rows("v", layer, spans, heads, lengths, pair)
        return keys, values

    def _rows(
        self,
        kind: str,
        layer: int,
        spans: torch.Tensor,
        heads: torch.Tensor,
        lengths: torch.Tensor,
        pair: torch.Tensor,
    ) -> torch.Tensor:
        """(T, D) rows of one kind for (span, head) pairs of ``lengths`` (``pair``: each row's
        pair), in the model dtype on the device.

        The pairs' coefficient rows are read from the offload tier in one call: a raw span's are
        its rows. Factorised spans' coefficients and bases are scattered into zero-padded
        (m, M, R) and (m, R, D) blocks and multiplied in one batched product; a rank gate
        (trained) decides per pair how many of the stored ranks to use.
        """
        t, D = self.tables, self.head_dim
        rank = t[f"{kind}_rank"][layer, heads, spans].long()
        raw = t[f"{kind}_raw"][layer, heads, spans].bool()
        start = t[f"{kind}_coef_off"][layer, heads, spans].long()
        flat = self.store.offload_ranges(f"{kind}_coef", start, start + lengths * rank)
        if bool(raw.all()):  # the common case: stored rows, nothing to multiply
            return flat.view(-1, D).to(device=self.device, dtype=self.dtype, non_blocking=True)
        out = torch.empty(pair.numel(), D, device=self.device, dtype=self.dtype)
        element = torch.repeat_interleave(raw, lengths * rank)  # (elements,) of a raw pair
        raw_rows = raw[pair].to(self.device)
        out[raw_rows] = flat[element].view(-1, D).to(device=self.device, dtype=self.dtype)
        low = ~raw
        m, r, n = int(low.sum()), rank[low], lengths[low]
        M, R = int(n.max()), int(r.max())
        coef = padded_blocks(flat[~element], n, r, (m, M, R))
        b0 = t[f"{kind}_basis_off"][layer, heads[low], spans[low]].long()
        flat = self.store.offload_ranges(f"{kind}_basis", b0, b0 + r * D)
        basis = padded_blocks(flat, r, torch.full_like(r, D), (m, R, D))
        if self.rank_gate is not None:  # coef = U diag(s): column norms are the spectrum
            sigma = coef.float().norm(dim=1)  # (m, R), 0-padded
            r = torch.minimum(self.rank_gate(kind, layer, heads[low], sigma), r)
            basis[torch.arange(R)[None, :] >= r[:, None]] = 0
        coef = coef.to(device=self.device, dtype=self.dtype, non_blocking=True)
        basis = basis.to(device=self.device, dtype=self.dtype, non_blocking=True)
        real = (torch.arange(M)[None, :] < n[:, None]).to(self.device)  # (m, M)
        out[~raw_rows] = (coef @ basis)[real]
        self.rank_sum[kind] += int(r.sum())
        self.rank_count[kind] += m
        return out

    def mean_rank(self, kind: str) -> float | None:
        """Mean rank of the factorised (non-raw) reconstructions so far."""
        n = self.rank_count[kind]
        return round(self.rank_sum[kind] / n, 2) if n else None

    def zoom_pool(self, layer: int, zoom: torch.Tensor, summaries: bool = False) -> ZoomPool:
        """Reconstructed tokens of the spans each KV head zoomed, padded to a common length.

        zoom : (H, N) bool; ``summaries``: the caller's softmax also reads the span summaries
        (counted in the live bytes). Returns the pool: K, V (H, P, D) as Rows, each head's
        tokens in document order, and owner (H, P), the span of each pooled token, -1 on
        padding. A layer whose picks did not change since its last call gets the same pool
        back; otherwise (measured: most decoding steps change some of a layer's picks) the
        tokens of spans the layer's last pool already held are copied from it (on the device)
        and only the newly zoomed (span, head) pairs are reconstructed, all in one batch. The
        pool is the layer's only copy of its reconstructions: a zoomed token costs its K/V once
        (``token_bytes``; plus, while one layer's pool is rebuilt, that layer's old pool and
        new reconstructions, and the memory entries attention reads in the model dtype: see
        :meth:`zoom_bytes`). Bounded memories place each head's pool in document order right
        before ``pool_end``.
        """
        H, D = self.num_kv_heads, self.head_dim
        last = self._pools.get(layer)
        if last is not None and last.pool_end == self.pool_end and torch.equal(last.zoom, zoom):
            return last
        if self.bounded and self.pool_end is None:
            raise RuntimeError("a bounded span memory needs pool_end (the first local position)")
        # each head's zoomed span tokens (rows of the sketch order), ascending; padding: ABSENT
        chosen = zoom[:, self.sketch_span]  # (H, S)
        sizes = chosen.sum(dim=1)  # (H,)
        P = int(sizes.max()) if sizes.numel() else 0
        rows = torch.arange(chosen.shape[1], device=zoom.device, dtype=torch.int32).expand(H, -1)
        ids = rows.where(chosen, ABSENT).sort(dim=1).values[:, :P].contiguous()  # (H, P)
        present = ids != ABSENT
        keys = Rows.empty(H, P, D, self.kv_bits, self.device)
        values = Rows.empty(H, P, D, self.kv_bits, self.device)
        reused = torch.zeros_like(present)
        if last is not None and last.ids.shape[1] and P:  # copy what the last pool holds
            at = torch.searchsorted(last.ids, ids).clamp(max=last.ids.shape[1] - 1)
            reused = present & (last.ids.gather(1, at) == ids)
            keys.fill(reused, last.stored_keys.gather(at).select(reused))
            values.fill(reused, last.values.gather(at).select(reused))
        new = present & ~reused  # whole spans: a pool holds every token of its spans
        span_of = self.sketch_span[ids.clamp(max=self.sketch_span.numel() - 1).long()]  # (H, P)
        pair = (torch.arange(H, device=zoom.device)[:, None] * self.n_spans + span_of)[new]
        pairs = torch.unique_consecutive(pair).cpu()  # (head, span) in pool order
        if pairs.numel():
            k, v = self.reconstruct(layer, pairs % self.n_spans, pairs // self.n_spans)
            self.reconstructions += int(pairs.numel())
            keys.fill(new, Rows.encode(k, self.kv_bits))
            values.fill(new, Rows.encode(v, self.kv_bits))
        owner = span_of.where(present, -1).to(torch.int32)  # with ids: 8 bytes per slot
        # live now: every layer's pool, this layer's old pool (until it goes), the new
        # reconstructions, and this call's memory entries in the model dtype for the softmax
        old_pool = last.tokens if last is not None else 0
        pooled = H * P + sum(pool.tokens for i, pool in self._pools.items() if i != layer)
        raw_keys = H * P // 2 if self.bounded else 0  # bounded: the unrotated keys stay too
        live = (pooled + old_pool + int(new.sum()) + raw_keys) * self.token_bytes
        self.peak_cached_bytes = max(self.peak_cached_bytes, live + self._entry_bytes(P, summaries))
        stored_keys = keys
        if self.bounded and P:  # right-aligned: head h's tokens at pool_end - size_h ...
            pos = torch.arange(P)[None] + (self.pool_end - sizes.cpu())[:, None]  # (H, P)
            like = torch.zeros(1, device=self.device, dtype=self.dtype)
            cos, sin = (t.view(H, P, D) for t in self.rope.tables(pos.clamp(min=0).flatten(), like))
            k = keys.read(self.dtype)
            keys = Rows.encode(k * cos + rotate_half(k) * sin, self.kv_bits)
        pool = ZoomPool(keys, values, owner, ids, zoom.clone(), self.pool_end, stored_keys)
        self._pools[layer] = pool
        return pool

    def _entry_bytes(self, pooled: int, summaries: bool, near: int = 0) -> int:
        """The memory entries one attention call reads in the model dtype (fixed, summaries when
        read, ``pooled`` zoomed tokens per KV head): K and V; and ``near`` spans' values."""
        entries = self.fixed_tokens + (self.n_spans if summaries else 0) + pooled
        return self.num_kv_heads * (2 * entries + near) * self.head_dim * self.dtype.itemsize

    @property
    def mean_span_length(self) -> float:
        return self.span_tokens / self.n_spans if self.n_spans else 0.0

    def zoom_bytes(self, tokens: int, summaries: bool = False, near_share: float = 0.0) -> int:
        """Peak bytes an answer's zoom takes when every layer's pool holds ``tokens`` per KV head
        (what :meth:`zoom_pool` counts at its worst: all pools, one layer's old pool and new
        reconstructions, bounded memories' unrotated keys, one call's entries in the model
        dtype, with ``near_share``'s near spans' values). Memory targets turn into zoom budgets
        with it."""
        held = self.num_layers + 2 + (0.5 if self.bounded else 0.0)
        near = near_count(near_share, tokens, self.mean_span_length)
        return int(self.num_kv_heads * tokens * held * self.token_bytes) + self._entry_bytes(
            tokens, summaries, near
        )

    def all_span_keys(self, layer: int) -> torch.Tensor:
        """Every span token's key of one layer (H, S, D), for the oracle diagnostic only: kept
        apart from the zoom pools and not counted as answer memory (bounded memories: pre-RoPE,
        the routers' frame)."""
        if layer not in self._oracle_keys:
            H, N = self.num_kv_heads, self.n_spans
            if N:
                heads = torch.arange(H).repeat_interleave(N)
                keys, _ = self.reconstruct(layer, torch.arange(N).repeat(H), heads)
                keys = keys.view(H, -1, self.head_dim)
            else:
                keys = torch.zeros(H, 0, self.head_dim, device=self.device)
            self._oracle_keys[layer] = keys
        return self._oracle_keys[layer]

    def representative_scores(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """(H, N) sketch logit (unscaled) of each span's best representative token for queries
        ``q`` (H, G, Tq, D): the exact sketch score restricted to a few rows per span."""
        H = q.shape[0]
        rows = self.span_reps.flatten()  # (N * k,)
        best = sketch_logits(self, layer, q, rows).amax(dim=(1, 2))  # (H, N * k)
        return best.view(H, self.n_spans, -1).amax(dim=-1)

    def candidates(
        self,
        layer: int,
        q: torch.Tensor,
        budget: int,
        keep: int = PREFILTER_KEEP,
        min_spans: int = PREFILTER_SPANS,
    ) -> torch.Tensor | None:
        """Spans worth scoring for queries ``q`` (H, G, Tq, D), or None to score them all.

        Long documents only (more than ``min_spans`` spans): the union over KV heads of each
        head's best max(keep, 4 x budget / mean span length) spans by
        :meth:`representative_scores` (sorted span ids). Measured on a generated book, the
        exact sketch router's picks are not all among the best representatives (a span can
        win on a token of low surprisal): this trades routing fidelity for flat cost.
        """
        if self.span_reps is None or self.n_spans <= min_spans:
            return None
        best = self.representative_scores(layer, q)  # (H, N)
        mean_len = float(self.lengths.float().mean())
        keep = min(self.n_spans, max(keep, math.ceil(4 * budget / mean_len)))
        picked = torch.zeros(self.n_spans, dtype=torch.bool, device=best.device)
        picked[best.topk(keep, dim=1).indices.flatten()] = True
        return torch.nonzero(picked)[:, 0]

    def subset(self, layer: int, index: torch.Tensor) -> SpanSubset:
        return SpanSubset(self, layer, index)


@dataclass
class ZoomPool:
    """One layer's zoomed tokens: K, V (H, P, D) as Rows; owner (H, P), -1 on padding.

    ids (H, P): each slot's span token (row of the sketch order), ascending, ``ABSENT`` on
    padding; zoom (H, N), pool_end: the picks it was built for; stored_keys: the keys as
    reconstructed (bounded memories: pre-RoPE, ``keys`` are rotated to the pool's positions).
    """

    keys: Rows
    values: Rows
    owner: torch.Tensor
    ids: torch.Tensor
    zoom: torch.Tensor
    pool_end: int | None
    stored_keys: Rows

    @property
    def tokens(self) -> int:
        """Head-tokens held (padding included)."""
        return self.owner.numel()

    def kv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.read(dtype), self.values.read(dtype)


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

    Span ids are local (0..K-1); the caller maps the scores back with ``index``.
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

    @property
    def summary_k(self) -> _OneLayer:
        return _OneLayer(self.layer, self.memory.summary_k[self.layer][:, self._pick()])

    @property
    def summary_v(self) -> _OneLayer:
        return _OneLayer(self.layer, self.memory.summary_v[self.layer][:, self._pick()])

    def _pick(self) -> torch.Tensor:
        has_summaries = self.memory.n_summaries == self.memory.n_spans  # not while streaming
        return self.index if has_summaries else self.index[:0]

    def all_span_keys(self, layer: int) -> torch.Tensor:
        return self.memory.all_span_keys(layer)[:, self.rows]


@dataclass
class ZoomTrace:
    """What the router did during one answer, accumulated on the device (no host syncs)."""

    zoomed: torch.Tensor | None = None  # (L, H, N) bool: (layer, head) zoomed the span
    best_margin: torch.Tensor | None = None  # (N,) best score - threshold when zoomed
    best_score: torch.Tensor | None = None  # (N,) the score at that best margin
    best_threshold: torch.Tensor | None = None  # (N,) the threshold at that best margin
    tokens_max: torch.Tensor | None = None  # () most reconstructed tokens one (layer, head) used
    mass: torch.Tensor | None = None  # (N + 1,) attention share of zoomed tokens (+ padding)
    calls: int = 0  # attention calls that contributed to ``mass`` (layers x steps)
    recall: torch.Tensor | None = None  # (2,) oracle-picked spans also picked, oracle-picked
    # (3,) summed over decisions: share of the exact span attention held by the zoomed spans,
    # by the oracle's picks, and the number of decisions (see :meth:`add_captured`)
    captured: torch.Tensor | None = None

    def record(
        self,
        layer: int,
        num_layers: int,
        zoom: torch.Tensor,
        scores: torch.Tensor,
        threshold: torch.Tensor,
        lengths: torch.Tensor,
    ) -> None:
        """zoom, scores: (H, N); threshold: (H,)."""
        H, N = zoom.shape
        if self.zoomed is None:
            self.zoomed = torch.zeros(num_layers, H, N, dtype=torch.bool, device=zoom.device)
            self.best_margin = scores.new_full((N,), float("-inf"))
            self.best_score, self.best_threshold = scores.new_zeros(N), scores.new_zeros(N)
            self.tokens_max = lengths.new_zeros(())
            self.recall = lengths.new_zeros(2)
        self.zoomed[layer] |= zoom
        margin = torch.where(zoom, scores - threshold[:, None], float("-inf"))  # (H, N)
        best, head = margin.max(dim=0)  # (N,)
        better = best > self.best_margin
        self.best_margin = torch.where(better, best, self.best_margin)
        self.best_score = torch.where(better, scores.gather(0, head[None])[0], self.best_score)
        self.best_threshold = torch.where(better, threshold[head], self.best_threshold)
        used = (zoom * lengths[None]).sum(dim=1).max()
        self.tokens_max = torch.maximum(self.tokens_max, used)

    def add_recall(self, zoom: torch.Tensor, oracle_zoom: torch.Tensor) -> None:
        self.recall += torch.stack([(zoom & oracle_zoom).sum(), oracle_zoom.sum()])

    def add_captured(self, zoom: torch.Tensor, oracle_zoom: torch.Tensor, share: torch.Tensor):
        """One decision's zoom and the oracle's (H, N) against ``share`` (H, N): each span's
        share of the attention the span tokens get with their exact keys (each head's row sums
        to 1). Accumulates the mean over KV heads of the share each selection holds."""
        held = torch.stack([(zoom * share).sum(), (oracle_zoom * share).sum()]) / zoom.shape[0]
        step = torch.cat([held.float(), held.new_ones(1).float()])
        self.captured = step if self.captured is None else self.captured + step

    def add_mass(self, owner: torch.Tensor, pool_mass: torch.Tensor, n_spans: int) -> None:
        """Accumulate the attention share of zoomed tokens per span (stays on the device)."""
        if self.mass is None:
            self.mass = pool_mass.new_zeros(n_spans + 1)  # the last slot collects padding
        self.mass.index_add_(0, owner.flatten() % (n_spans + 1), pool_mass.flatten())
        self.calls += 1

    def spans(self) -> list[dict]:
        """Per zoomed span: layers, (layer, head) pairs, best score/threshold, attention share.

        One host copy per answer.
        """
        if self.zoomed is None:
            return []
        layers = self.zoomed.any(dim=1).sum(dim=0)  # (N,)
        heads = self.zoomed.sum(dim=(0, 1))  # (N,)
        share = self.mass[:-1] / max(self.calls, 1) if self.mass is not None else heads * 0.0
        rows = torch.stack(
            [
                layers.float(),
                heads.float(),
                self.best_score.float(),
                self.best_threshold.float(),
                share.float(),
            ],
            dim=1,
        ).tolist()
        return [
            {
                "span": n,
                "layers": int(r[0]),
                "heads": int(r[1]),
                "score": r[2],
                "threshold": r[3],
                "attention": r[4],
            }
            for n, r in enumerate(rows)
            if r[1] > 0
        ]

    @property
    def zoomed_tokens_max(self) -> int:
        return int(self.tokens_max) if self.tokens_max is not None else 0

    @property
    def zoom_rate(self) -> float:
        """Share of (layer, KV head, span) triples zoomed at least once during the answer."""
        return float(self.zoomed.float().mean()) if self.zoomed is not None else 0.0

    @property
    def mass_captured(self) -> tuple[float, float] | None:
        """Mean share of the exact span attention held by the zoomed spans and by the oracle's
        picks over the answer's decisions (None when not measured)."""
        if self.captured is None:
            return None
        zoomed, oracle, n = self.captured.tolist()
        return zoomed / n, oracle / n

    @property
    def recall_vs_oracle(self) -> float | None:
        if self.recall is None:
            return None
        hits, total = self.recall.tolist()
        return hits / total if total else 1.0
