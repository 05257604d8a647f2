"""A streamed build's chunks read through the zoom (the reader :mod:`sekv_core.store.stream` is
handed by :func:`sekv_core.ingest.open_or_build`).

Each chunk runs through the model with the mixed-resolution attention (:mod:`.attention`): it
attends to the sinks, the waiting tokens (full resolution, :class:`~.attention.LocalWindow`) and
the spans zoomed from the store built so far (:class:`~.memory.SpanMemory` over the growing store,
16-bit: what a chunk attends to is part of the store). The sketch router zooms ``budget`` tokens
per layer and KV head, routed by ``route_queries`` of the chunk's queries; beyond
STREAM_PREFILTER_SPANS spans only the candidates of :func:`~.prefilter.candidates`, found
through its coarse block index, are scored, so the time per chunk stays flat along the book.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from ..models import LoadedModel
from ..rope import Rope
from ..sketch import QueryMoments
from .attention import LocalWindow, ZoomPolicy, sekv_attention
from .memory import SpanMemory, StoreView
from .router import SketchRouter

# a chunk's router scores exactly only the best 64 spans per KV head by their representative
# tokens (found through the block index) once the store holds 256 spans: the cost per chunk
# stays flat
STREAM_PREFILTER_SPANS, STREAM_PREFILTER_KEEP = 256, 64


class ZoomedChunks:
    """Reads one stream's chunks: :meth:`start` on the growing store once the sinks are known,
    :meth:`refresh` after each part it gains, :meth:`read` per chunk inside :meth:`attending`."""

    def __init__(self, loaded: LoadedModel, rope: Rope, budget: int, route_queries: int) -> None:
        self.loaded, self.rope = loaded, rope
        self.budget, self.route_queries = budget, route_queries
        self.memory: SpanMemory | None = None

    def attending(self) -> AbstractContextManager[None]:
        """The model's attention is the mixed-resolution one inside the block."""
        return sekv_attention(self.loaded.model)

    def start(self, store: StoreView) -> None:
        """Zoom into ``store`` (the sinks, no spans yet) from the next chunk on."""
        loaded = self.loaded
        self.memory = SpanMemory(store, self.rope, loaded.device, loaded.dtype, kv_bits=16)

    def refresh(self) -> None:
        """The store gained a part: its spans can be zoomed."""
        assert self.memory is not None
        self.memory.refresh()

    def read(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        window: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        moments: QueryMoments | None,
        pool_end: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One chunk's forward: ``ids``, ``positions`` (c,); ``window`` the waiting tokens' keys
        (pre-RoPE), values (L, H, W, D) and the RoPE cos, sin (W, D) of their positions;
        ``moments`` sums the chunk's queries' second moments when given; ``pool_end`` the first
        local position (None: the first chunk, nothing to zoom). Returns the last hidden states
        (c, hidden) and the chunk's post-RoPE keys and values (L, H, c, D)."""
        local = LocalWindow(*window, moments=moments)
        memory, policy = None, None
        if pool_end is not None:
            memory = self.memory
            assert memory is not None
            policy = chunk_policy(self.budget, self.route_queries, pool_end)
        out = self.loaded.model.get_decoder()(
            input_ids=ids[None],
            position_ids=positions[None].to(self.loaded.device),
            use_cache=False,
            sekv_memory=memory,
            sekv_policy=policy,
            sekv_window=local,
        )
        keys = torch.stack([k for k, _ in local.captured])  # (L, H, c, D) post-RoPE
        values = torch.stack([v for _, v in local.captured])
        return out.last_hidden_state[0], keys, values

    def resident_bytes(self) -> int:
        """Bytes the memory holds on the device (0 before :meth:`start`)."""
        return self.memory.resident_bytes() if self.memory else 0


def chunk_policy(budget: int, route_queries: int, pool_end: int) -> ZoomPolicy:
    """How a chunk zooms into the store built so far: the sketch router, ``budget`` tokens per
    (layer, KV head), routed by ``route_queries`` of its queries, prefiltered on long stores;
    a bounded store's zoomed tokens end before ``pool_end``, the chunk's first position."""
    return ZoomPolicy(
        SketchRouter(),
        budget=budget,
        route_queries=route_queries,
        track_mass=False,
        prefilter_spans=STREAM_PREFILTER_SPANS,
        prefilter_keep=STREAM_PREFILTER_KEEP,
        prefilter_blocks=True,
        ordered=True,
        pool_end=pool_end,
    )
