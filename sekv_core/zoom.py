"""Span memory at answer time: the resident tier on the model device, zoom-in reconstructions.

:class:`SpanMemory` holds what attention reads every step (sinks + anchors K/V, span summaries,
routing sketch) and reconstructs token-level K/V of a span from the offloaded bases on demand,
keeping reconstructions in a small per-(layer, span) cache so decoding does not rebuild them.
:class:`ZoomTrace` records which spans were zoomed, where, and why (score vs threshold).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .basis import BASIS_DTYPE
from .rope import Rope, rotate_half
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
        self.log_len = self.lengths.float().log()  # (N,)
        self.n_spans = int(self.starts.numel())
        self.sketch_span = torch.repeat_interleave(
            torch.arange(self.n_spans), self.ends - self.starts
        ).to(device)  # (S,) span of each span token
        self.num_layers, self.num_kv_heads, _, self.head_dim = self.fixed_k.shape
        # RoPE tables of the context positions, to rotate reconstructed pre-RoPE keys
        context = int(store.manifest["document"]["context_tokens"])
        like = torch.zeros(1, device=device, dtype=dtype)
        self.cos, self.sin = rope.tables(torch.arange(context), like)  # (T, D)
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
        # optional rank gate (trained): (kind, layer, head, coef (|S|, r)) -> rank to keep
        self.rank_gate: Callable[[str, int, int, torch.Tensor], int] | None = None
        self.rank_sum = {"k": 0, "v": 0}  # ranks used by factorised reconstructions
        self.rank_count = {"k": 0, "v": 0}
        self._oracle_keys: dict[int, torch.Tensor] = {}
        # per layer: the last zoom picks and the pool built for them (reused while unchanged)
        self._pools: dict[int, tuple[list[list[int]], tuple[torch.Tensor, ...]]] = {}

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
            self.cos,
            self.sin,
            *self.tables.values(),
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
        """Token-level K, V (|S|, D) of one span for one KV head; reconstructed once (LRU)."""
        layer_cache = self.cache[layer]
        hit = layer_cache.get((span, head))
        if hit is not None:
            layer_cache.move_to_end((span, head))
            return hit
        s, e = int(self.starts[span]), int(self.ends[span])
        keys = self._reconstruct("k", layer, span, head)  # pre-RoPE: rotate to its positions
        keys = keys * self.cos[s:e] + rotate_half(keys) * self.sin[s:e]
        hit = (keys.to(CACHE_DTYPE), self._reconstruct("v", layer, span, head).to(CACHE_DTYPE))
        layer_cache[(span, head)] = hit
        self.cache_tokens[layer] += e - s
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

    def zoom_pool(
        self, layer: int, zoom: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Reconstructed tokens of the spans each KV head zoomed, padded to a common length.

        zoom : (H, N) bool. Returns K, V (H, P, D) in CACHE_DTYPE and owner (H, P): the span of
        each pooled token, -1 on padding. A layer whose picks did not change since its last call
        gets the same pool back (decoding rarely changes the zoom from one token to the next).
        """
        H, D = self.num_kv_heads, self.head_dim
        picks = [torch.nonzero(row)[:, 0].tolist() for row in zoom.cpu()]  # host: which reads
        last = self._pools.get(layer)
        if last is not None and last[0] == picks:  # same zoom as this layer's last call: reuse
            return last[1]
        per_head = [[self.span_kv(layer, s, h) for s in spans] for h, spans in enumerate(picks)]
        sizes = [sum(k.shape[0] for k, _ in kv) for kv in per_head]
        P = max(sizes, default=0)
        keys = self.fixed_k.new_zeros(H, P, D, dtype=CACHE_DTYPE)
        values = self.fixed_k.new_zeros(H, P, D, dtype=CACHE_DTYPE)
        owner = torch.full((H, P), -1, dtype=torch.long)
        for h, (spans, kv) in enumerate(zip(picks, per_head, strict=True)):
            if kv:
                keys[h, : sizes[h]] = torch.cat([k for k, _ in kv])
                values[h, : sizes[h]] = torch.cat([v for _, v in kv])
                owner[h, : sizes[h]] = torch.repeat_interleave(
                    torch.tensor(spans), torch.tensor([k.shape[0] for k, _ in kv])
                )
        self._pools[layer] = (picks, (keys, values, owner.to(self.device)))
        pooled = sum(k.shape[0] * k.shape[1] for _, (k, _, _) in self._pools.values())
        # live: the cache + every layer's pool (fp16) + this call's memory entries (fixed,
        # summaries, pool) copied to the model dtype for the softmax
        entries = self.fixed_k.shape[2] + self.n_spans + P
        live = (
            self.cached_bytes()
            + pooled * self.token_bytes
            + H * entries * 2 * D * self.dtype.itemsize
        )
        self.peak_cached_bytes = max(self.peak_cached_bytes, live)
        return self._pools[layer][1]

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
    def recall_vs_oracle(self) -> float | None:
        if self.recall is None:
            return None
        hits, total = self.recall.tolist()
        return hits / total if total else 1.0
