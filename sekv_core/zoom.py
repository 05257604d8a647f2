"""Span memory at answer time: the resident tier on the model device, zoom-in reconstructions.

:class:`SpanMemory` holds what attention reads every step (sinks + anchors K/V, span summaries,
routing sketch) and reconstructs token-level K/V of a span from the offloaded bases on demand,
keeping reconstructions in a small per-(layer, span) cache so decoding does not rebuild them.
:class:`ZoomTrace` records which spans were zoomed, where, and why (score vs threshold).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .basis import BASIS_DTYPE
from .rope import Rope
from .store import SpanStore

CACHE_DTYPE = BASIS_DTYPE  # reconstructions wait between steps in half precision


class SpanMemory:
    """Device-side view of a span store for one model; shared by all questions."""

    def __init__(
        self, store: SpanStore, rope: Rope, device: torch.device, dtype: torch.dtype
    ) -> None:
        r = store.resident
        self.store, self.rope, self.device, self.dtype = store, rope, device, dtype
        self.fixed_k, self.fixed_v = r["fixed_k"], r["fixed_v"]  # (L, H, F, D)
        self.summary_k, self.summary_v = r["summary_k"], r["summary_v"]  # (L, H, N, D)
        self.sketch_proj, self.sketch = r["sketch_proj"], r["sketch"]  # (L,H,D,R) (L,H,S,R)
        self.sketch_scale = r["sketch_scale"]  # (L, H, R)
        self.starts, self.ends = r["span_starts"], r["span_ends"]  # (N,) CPU
        self.lengths = (self.ends - self.starts).to(device)
        self.log_len = self.lengths.to(dtype).log()  # (N,)
        self.n_spans = int(self.starts.numel())
        self.sketch_span = torch.repeat_interleave(
            torch.arange(self.n_spans), self.ends - self.starts
        ).to(device)  # (S,) span of each span token
        self.num_layers, self.num_kv_heads, _, self.head_dim = self.fixed_k.shape
        self.tables = {k: v for k, v in r.items() if k.startswith(("k_", "v_"))}
        # per layer: (span, head) -> reconstructed (K, V) in fp16, least recently used first
        self.cache: list[OrderedDict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]] = [
            OrderedDict() for _ in range(self.num_layers)
        ]
        self.cache_tokens = [0] * self.num_layers
        self.capacity = 0  # head-tokens kept per layer between steps (set per answer)
        self.token_bytes = 2 * self.head_dim * CACHE_DTYPE.itemsize  # K + V of one head-token
        self.peak_cached_bytes = 0
        self.reconstructions = 0
        self._oracle_keys: dict[int, torch.Tensor] = {}

    def resident_bytes(self) -> int:
        """Bytes of the resident tier held on the device (routing structures included)."""
        tensors = [
            self.fixed_k,
            self.fixed_v,
            self.summary_k,
            self.summary_v,
            self.sketch_proj,
            self.sketch,
            self.sketch_scale,
            self.lengths,
            self.sketch_span,
            *self.tables.values(),
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    def cached_bytes(self) -> int:
        return sum(self.cache_tokens) * self.token_bytes

    def clear(self, capacity: int) -> None:
        """Drop reconstructions (between questions); keep ``capacity`` head-tokens per layer."""
        for layer_cache in self.cache:
            layer_cache.clear()
        self.cache_tokens = [0] * self.num_layers
        self.capacity = capacity
        self.peak_cached_bytes = 0

    def span_kv(self, layer: int, span: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-level K, V (|S|, D) of one span for one KV head; reconstructed once (LRU)."""
        layer_cache = self.cache[layer]
        hit = layer_cache.get((span, head))
        if hit is not None:
            layer_cache.move_to_end((span, head))
            return hit
        positions = torch.arange(int(self.starts[span]), int(self.ends[span]))
        keys = self.rope.rotate(self._reconstruct("k", layer, span, head), positions)  # pre-RoPE
        hit = (keys.to(CACHE_DTYPE), self._reconstruct("v", layer, span, head).to(CACHE_DTYPE))
        layer_cache[(span, head)] = hit
        self.cache_tokens[layer] += len(positions)
        while self.cache_tokens[layer] > self.capacity and len(layer_cache) > 1:
            _, (old, _) = layer_cache.popitem(last=False)
            self.cache_tokens[layer] -= old.shape[0]
        self.reconstructions += 1
        return hit

    def _reconstruct(self, kind: str, layer: int, span: int, head: int) -> torch.Tensor:
        """Read one (layer, span, head) factor pair from the offload tier; multiply on device."""
        t, D = self.tables, self.head_dim
        length = int(self.ends[span] - self.starts[span])
        r = int(t[f"{kind}_rank"][layer, head, span])
        c0 = int(t[f"{kind}_coef_off"][layer, head, span])
        coef = self.store.offload_slice(f"{kind}_coef", c0, c0 + length * r)
        coef = coef.to(self.device, non_blocking=True).view(length, r).to(self.dtype)
        if t[f"{kind}_raw"][layer, head, span]:
            return coef
        b0 = int(t[f"{kind}_basis_off"][layer, head, span])
        basis = self.store.offload_slice(f"{kind}_basis", b0, b0 + r * D)
        return coef @ basis.to(self.device, non_blocking=True).view(r, D).to(self.dtype)

    def zoom_pool(
        self, layer: int, zoom: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Reconstructed tokens of the spans each KV head zoomed, padded to a common length.

        zoom : (H, N) bool. Returns K, V (H, P, D) in the model dtype and owner (H, P): the span
        of each pooled token, -1 on padding.
        """
        H, D = self.num_kv_heads, self.head_dim
        picks = [torch.nonzero(row)[:, 0].tolist() for row in zoom.cpu()]  # host: which reads
        per_head = [[self.span_kv(layer, s, h) for s in spans] for h, spans in enumerate(picks)]
        sizes = [sum(k.shape[0] for k, _ in kv) for kv in per_head]
        P = max(sizes, default=0)
        keys = self.fixed_k.new_zeros(H, P, D)
        values = self.fixed_k.new_zeros(H, P, D)
        owner = torch.full((H, P), -1, dtype=torch.long)
        for h, (spans, kv) in enumerate(zip(picks, per_head, strict=True)):
            if kv:
                keys[h, : sizes[h]] = torch.cat([k for k, _ in kv])
                values[h, : sizes[h]] = torch.cat([v for _, v in kv])
                owner[h, : sizes[h]] = torch.repeat_interleave(
                    torch.tensor(spans), torch.tensor([k.shape[0] for k, _ in kv])
                )
        live = self.cached_bytes() + H * P * 2 * D * self.dtype.itemsize  # cache + this pool
        self.peak_cached_bytes = max(self.peak_cached_bytes, live)
        return keys, values, owner.to(self.device)

    def all_span_keys(self, layer: int) -> torch.Tensor:
        """Every span token's key of one layer (H, S, D), for the oracle diagnostic only: kept
        apart from the zoom cache and not counted as answer memory."""
        if layer not in self._oracle_keys:
            heads = range(self.num_kv_heads)
            keys = [
                self.rope.rotate(
                    torch.stack([self._reconstruct("k", layer, s, h) for h in heads]),
                    torch.arange(int(self.starts[s]), int(self.ends[s])),
                )
                for s in range(self.n_spans)
            ]
            self._oracle_keys[layer] = (
                torch.cat(keys, dim=1) if keys else self.fixed_k[layer][:, :0]
            )
        return self._oracle_keys[layer]


@dataclass
class ZoomTrace:
    """What the router did during one answer."""

    heads: dict[int, set[tuple[int, int]]] = field(default_factory=dict)  # span -> {(layer, h)}
    best: dict[int, tuple[float, float]] = field(default_factory=dict)  # span -> (score, thr)
    recall_hits: int = 0
    recall_total: int = 0
    zoomed_tokens_max: int = 0  # most reconstructed tokens one (layer, head) attended to
    mass: torch.Tensor | None = None  # (N + 1,) attention share each span's tokens received, summed
    calls: int = 0  # attention calls that contributed to ``mass`` (layers x steps)

    def add_mass(self, owner: torch.Tensor, pool_mass: torch.Tensor, n_spans: int) -> None:
        """Accumulate the attention share of zoomed tokens per span (stays on the device)."""
        if self.mass is None:
            self.mass = pool_mass.new_zeros(n_spans + 1)  # the last slot collects padding
        self.mass.index_add_(0, owner.flatten().clamp(min=-1) % (n_spans + 1), pool_mass.flatten())
        self.calls += 1

    def attention_share(self) -> list[float]:
        """Mean attention share per span over all calls (host copy, once per answer)."""
        if self.mass is None or self.calls == 0:
            return []
        return (self.mass[:-1] / self.calls).tolist()

    def record(
        self,
        layer: int,
        zoom: torch.Tensor,
        scores: torch.Tensor,
        threshold: torch.Tensor,
        lengths: torch.Tensor,
    ) -> None:
        """zoom, scores: (H, N); threshold: (H,). One host sync per layer call."""
        heads, spans = torch.nonzero(zoom, as_tuple=True)
        if len(spans) == 0:
            return
        margin = (scores - threshold[:, None])[heads, spans]
        rows = torch.stack([heads, spans]).tolist()
        vals = torch.stack([scores[heads, spans], threshold[heads], margin]).tolist()
        for h, s, score, thr, m in zip(*rows, *vals, strict=True):
            self.heads.setdefault(s, set()).add((layer, h))
            old = self.best.get(s)
            if old is None or m > old[0] - old[1]:
                self.best[s] = (score, thr)
        per_head = (zoom * lengths[None]).sum(dim=1).max()
        self.zoomed_tokens_max = max(self.zoomed_tokens_max, int(per_head))
