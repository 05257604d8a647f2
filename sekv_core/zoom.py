"""Span memory at answer time: the resident tier on the model device, zoom-in reconstructions.

:class:`SpanMemory` holds what attention reads every step (sinks + anchors K/V, span summaries,
routing sketch) and reconstructs token-level K/V of a span from the offloaded bases on demand,
keeping reconstructions in a small per-(layer, span) cache so decoding does not rebuild them.
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
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .basis import BASIS_DTYPE
from .kvquant import CACHE_DTYPE, Rows, row_bytes
from .rope import Rope, rotate_half
from .sketch import sketch_logits
from .store import SpanStore

# token-level K/V on the device (zoomed spans' reconstructions, sinks, anchors) as int8 rows with
# one fp16 scale each (sekv_core.kvquant): ~1.9x the zoomed tokens per byte of fp16; measured on
# the default model, answers follow full KV's as closely (see docs/benchmarks.md, sixth pass)
KV_BITS = 8
# above this many spans (books of ~60K tokens), routers only score the spans whose representative
# tokens score among the best ``keep`` (or 4x the budget's worth of spans) per KV head
PREFILTER_SPANS = 2048
PREFILTER_KEEP = 256


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
        # per layer: (span, head) -> reconstructed K, V as Rows, least recently used first
        self.cache: list[OrderedDict[tuple[int, int], tuple[Rows, Rows]]] = [
            OrderedDict() for _ in range(self.num_layers)
        ]
        self.cache_tokens = [0] * self.num_layers
        self.capacity = 0  # head-tokens kept per layer between steps (set per answer)
        self.token_bytes = 2 * row_bytes(self.head_dim, kv_bits)  # K + V of one head-token
        self.peak_cached_bytes = 0
        self.reconstructions = 0
        # optional rank gate (trained): (kind, layer, head, coef (|S|, r)) -> rank to keep
        self.rank_gate: Callable[[str, int, int, torch.Tensor], int] | None = None
        self.rank_sum = {"k": 0, "v": 0}  # ranks used by factorised reconstructions
        self.rank_count = {"k": 0, "v": 0}
        # per layer: the last zoom picks and the pool built for them (reused while unchanged)
        self._pools: dict[int, tuple[list[list[int]], int | None, ZoomPool]] = {}

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

    def cached_bytes(self) -> int:
        return sum(self.cache_tokens) * self.token_bytes

    def clear(self, capacity: int) -> None:
        """Drop reconstructions (between questions); keep ``capacity`` head-tokens per layer."""
        for layer_cache in self.cache:
            layer_cache.clear()
        self._pools.clear()
        self.cache_tokens = [0] * self.num_layers
        self.capacity = capacity
        self.peak_cached_bytes = 0
        self.rank_sum, self.rank_count = {"k": 0, "v": 0}, {"k": 0, "v": 0}

    def span_kv(self, layer: int, span: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-level K, V (|S|, D) of one span for one KV head in CACHE_DTYPE, as the zoom
        holds them (8-bit zoom: read back from int8); reconstructed once (LRU)."""
        k, v = self.spans_kv(layer, [(span, head)])[0]
        return k.read(CACHE_DTYPE), v.read(CACHE_DTYPE)

    def spans_kv(self, layer: int, pairs: list[tuple[int, int]]) -> list[tuple[Rows, Rows]]:
        """Token-level K, V (|S|, D) of (span, head) ``pairs`` of one layer, as held (Rows).

        The ones not in the layer's LRU cache are reconstructed together: one batched product
        per tensor kind (many small matmuls cost far more than one, on a busy CPU above all).
        """
        layer_cache = self.cache[layer]
        missing = [p for p in dict.fromkeys(pairs) if p not in layer_cache]
        if missing:
            spans = torch.tensor([s for s, _ in missing])
            keys, lengths = self._reconstruct_many("k", layer, missing)  # (n, M, D) pre-RoPE
            if not self.bounded:  # bounded: kept pre-RoPE, rotated where the pool places it
                pos = (self.starts[spans][:, None] + torch.arange(keys.shape[1])[None]).clamp(
                    max=self.context_len - 1
                )  # (n, M)
                cos, sin = (t.view(*pos.shape, -1) for t in self.rope.tables(pos.flatten(), keys))
                keys = keys * cos + rotate_half(keys) * sin
            values, _ = self._reconstruct_many("v", layer, missing)
            keys, values = Rows.encode(keys, self.kv_bits), Rows.encode(values, self.kv_bits)
            for i, (pair, n) in enumerate(zip(missing, lengths, strict=True)):
                layer_cache[pair] = (keys.part(i, 0, n), values.part(i, 0, n))
                self.cache_tokens[layer] += n
            self.reconstructions += len(missing)
        out = []
        for pair in pairs:
            layer_cache.move_to_end(pair)
            out.append(layer_cache[pair])
        while self.cache_tokens[layer] > self.capacity and len(layer_cache) > 1:
            _, (old, _) = layer_cache.popitem(last=False)
            self.cache_tokens[layer] -= old.length
        return out

    def _reconstruct_many(
        self, kind: str, layer: int, pairs: list[tuple[int, int]]
    ) -> tuple[torch.Tensor, list[int]]:
        """Padded (n, M, D) reconstructions of (span, head) ``pairs`` and their lengths.

        Factors are gathered from the offload tier into zero-padded (n, M, r) and (n, r, D)
        blocks (raw spans: an identity basis) and multiplied in one batched product. With a rank
        gate, each pair goes through :meth:`_reconstruct` (the gate decides per factor).
        """
        t, D = self.tables, self.head_dim
        spans = torch.tensor([s for s, _ in pairs])
        heads = torch.tensor([h for _, h in pairs])
        lengths = (self.ends[spans] - self.starts[spans]).tolist()
        M = max(lengths)
        if self.rank_gate is not None:
            out = torch.zeros(len(pairs), M, D, device=self.device, dtype=self.dtype)
            for i, (span, head) in enumerate(pairs):
                out[i, : lengths[i]] = self._reconstruct(kind, layer, span, head)
            return out, lengths
        rank = t[f"{kind}_rank"][layer, heads, spans].tolist()
        raw = t[f"{kind}_raw"][layer, heads, spans].bool().tolist()
        c0 = t[f"{kind}_coef_off"][layer, heads, spans].tolist()
        b0 = t[f"{kind}_basis_off"][layer, heads, spans].tolist()
        R = max(rank)
        coef = torch.zeros(len(pairs), M, R, dtype=BASIS_DTYPE)  # gathered on the host
        basis = torch.zeros(len(pairs), R, D, dtype=BASIS_DTYPE)
        for i, (n, r) in enumerate(zip(lengths, rank, strict=True)):
            coef[i, :n, :r] = self.store.offload_slice(f"{kind}_coef", c0[i], c0[i] + n * r).view(
                n, r
            )
            if raw[i]:
                basis[i, :D] = torch.eye(D, dtype=BASIS_DTYPE)
            else:
                basis[i, :r] = self.store.offload_slice(f"{kind}_basis", b0[i], b0[i] + r * D).view(
                    r, D
                )
                self.rank_sum[kind] += r
                self.rank_count[kind] += 1
        coef = coef.to(device=self.device, dtype=self.dtype, non_blocking=True)
        basis = basis.to(device=self.device, dtype=self.dtype, non_blocking=True)
        return coef @ basis, lengths

    def _reconstruct(self, kind: str, layer: int, span: int, head: int) -> torch.Tensor:
        """Read one (layer, span, head) factor pair from the offload tier; multiply on device."""
        t, D = self.tables, self.head_dim
        length = int(self.ends[span] - self.starts[span])
        r = int(t[f"{kind}_rank"][layer, head, span])
        c0 = int(t[f"{kind}_coef_off"][layer, head, span])
        coef = self.store.offload_slice(f"{kind}_coef", c0, c0 + length * r).view(length, r)
        coef = coef.to(device=self.device, dtype=self.dtype, non_blocking=True)
        if t[f"{kind}_raw"][layer, head, span]:
            return coef
        b0 = int(t[f"{kind}_basis_off"][layer, head, span])
        basis = self.store.offload_slice(f"{kind}_basis", b0, b0 + r * D).view(r, D)
        if self.rank_gate is not None:  # coef = U diag(s): columns in descending s
            keep = max(1, min(r, self.rank_gate(kind, layer, head, coef)))
            coef, basis = coef[:, :keep], basis[:keep]
        self.rank_sum[kind] += coef.shape[1]
        self.rank_count[kind] += 1
        return coef @ basis.to(device=self.device, dtype=self.dtype, non_blocking=True)

    def mean_rank(self, kind: str) -> float | None:
        """Mean rank of the factorised (non-raw) reconstructions so far."""
        n = self.rank_count[kind]
        return round(self.rank_sum[kind] / n, 2) if n else None

    def zoom_pool(self, layer: int, zoom: torch.Tensor, summaries: bool = False) -> ZoomPool:
        """Reconstructed tokens of the spans each KV head zoomed, padded to a common length.

        zoom : (H, N) bool; ``summaries``: the caller's softmax also reads the span summaries
        (counted in the live bytes). Returns the pool: K, V (H, P, D) as Rows and owner (H, P),
        the span of each pooled token, -1 on padding. A layer whose picks did not change since
        its last call gets the same pool back (decoding rarely changes the zoom from one token
        to the next). The pool is the layer's only copy of its reconstructions: afterwards the
        layer's cache holds views into it, so a zoomed token costs its K/V once (``token_bytes``;
        plus, while one layer's pool is rebuilt, that layer's old pool and new reconstructions,
        and the memory entries attention reads in the model dtype: see :meth:`zoom_bytes`).
        Bounded memories place each head's pool in document order right before ``pool_end``.
        """
        H, D = self.num_kv_heads, self.head_dim
        picks = [torch.nonzero(row)[:, 0].tolist() for row in zoom.cpu()]  # host: which reads
        last = self._pools.get(layer)
        if last is not None and last[0] == picks and last[1] == self.pool_end:  # reuse
            return last[2]
        if self.bounded and self.pool_end is None:
            raise RuntimeError("a bounded span memory needs pool_end (the first local position)")
        pairs = [(s, h) for h, spans in enumerate(picks) for s in spans]
        found = iter(self.spans_kv(layer, pairs)) if pairs else iter(())
        per_head = [[next(found) for _ in spans] for spans in picks]
        sizes = [sum(k.length for k, _ in kv) for kv in per_head]
        P = max(sizes, default=0)
        keys = Rows.empty(H, P, D, self.kv_bits, self.device)
        values = Rows.empty(H, P, D, self.kv_bits, self.device)
        owner = torch.full((H, P), -1, dtype=torch.long)
        for h, (spans, kv) in enumerate(zip(picks, per_head, strict=True)):
            if kv:
                keys.put(h, [k for k, _ in kv])
                values.put(h, [v for _, v in kv])
                owner[h, : sizes[h]] = torch.repeat_interleave(
                    torch.tensor(spans), torch.tensor([k.length for k, _ in kv])
                )
        # live now: every layer's pool, this layer's old pool (until its views go), the new
        # reconstructions, and this call's memory entries in the model dtype for the softmax
        old_pool = last[2].tokens if last is not None else 0
        pooled = H * P + sum(pool.tokens for i, (_, _, pool) in self._pools.items() if i != layer)
        raw_keys = H * P // 2 if self.bounded else 0  # bounded: the unrotated keys stay too
        live = (
            self.cached_bytes()
            + (pooled + old_pool + raw_keys) * self.token_bytes
            + self._entry_bytes(P, summaries)
        )
        self.peak_cached_bytes = max(self.peak_cached_bytes, live)
        # the layer's cache becomes views into the pool (the reconstructions' only copy)
        layer_cache = self.cache[layer]
        layer_cache.clear()
        for h, spans in enumerate(picks):
            start = 0
            for span, (k, _) in zip(spans, per_head[h], strict=True):
                n = k.length
                layer_cache[(span, h)] = (
                    keys.part(h, start, start + n),
                    values.part(h, start, start + n),
                )
                start += n
        self.cache_tokens[layer] = 0
        if self.bounded and P:  # right-aligned: head h's tokens at pool_end - size_h ...
            pos = torch.arange(P)[None] + (self.pool_end - torch.tensor(sizes))[:, None]  # (H, P)
            like = torch.zeros(1, device=self.device, dtype=self.dtype)
            cos, sin = (t.view(H, P, D) for t in self.rope.tables(pos.clamp(min=0).flatten(), like))
            k = keys.read(self.dtype)
            keys = Rows.encode(k * cos + rotate_half(k) * sin, self.kv_bits)
        self._pools[layer] = (picks, self.pool_end, ZoomPool(keys, values, owner.to(self.device)))
        return self._pools[layer][2]

    def _entry_bytes(self, pooled: int, summaries: bool) -> int:
        """The memory entries one attention call reads in the model dtype (fixed, summaries when
        read, ``pooled`` zoomed tokens per KV head): K and V."""
        entries = self.fixed_tokens + (self.n_spans if summaries else 0) + pooled
        return self.num_kv_heads * entries * 2 * self.head_dim * self.dtype.itemsize

    def zoom_bytes(self, tokens: int, summaries: bool = False) -> int:
        """Peak bytes an answer's zoom takes when every layer's pool holds ``tokens`` per KV head
        (what :meth:`zoom_pool` counts at its worst: all pools, one layer's old pool and new
        reconstructions, bounded memories' unrotated keys, one call's entries in the model
        dtype). Memory targets turn into zoom budgets with it."""
        held = self.num_layers + 2 + (0.5 if self.bounded else 0.0)
        return int(self.num_kv_heads * tokens * held * self.token_bytes) + self._entry_bytes(
            tokens, summaries
        )

    def all_span_keys(self, layer: int) -> torch.Tensor:
        """Every span token's key of one layer (H, S, D), for the oracle diagnostic only: kept
        apart from the zoom cache and not counted as answer memory."""
        if layer not in self._oracle_keys:
            heads = range(self.num_kv_heads)
            keys = [
                self.rope.rotate(
                    torch.stack([self._reconstruct("k", layer, s, h) for h in heads]),
                    torch.arange(int(self.starts[s]), int(self.ends[s]))
                    * (not self.bounded),  # bounded: the routers' frame, position 0
                )
                for s in range(self.n_spans)
            ]
            self._oracle_keys[layer] = (
                torch.cat(keys, dim=1)
                if keys
                else torch.zeros(self.num_kv_heads, 0, self.head_dim, device=self.device)
            )
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
    """One layer's zoomed tokens: K, V (H, P, D) as Rows; owner (H, P), -1 on padding."""

    keys: Rows
    values: Rows
    owner: torch.Tensor

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
    def recall_vs_oracle(self) -> float | None:
        if self.recall is None:
            return None
        hits, total = self.recall.tolist()
        return hits / total if total else 1.0
