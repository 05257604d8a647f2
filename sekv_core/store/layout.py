"""Where a streamed build's tokens sit: sinks, zoom band, waiting tokens, chunk sizes.

:class:`StreamLayout` plans one stream (:mod:`sekv_core.store.stream`): a context beyond the model's
window gets *bounded* positions (pre-RoPE keys, chunks placed within the window), smaller
chunks and zoom budget on a small window; a context that fits keeps its original positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import exceeds_window
from ..errors import SekvError
from ..rope import Rope
from ..segment import n_sinks
from .format import StoreSource


@dataclass(frozen=True)
class StreamLayout:
    """The sizes and positions of one stream (see "Positions" in :mod:`sekv_core.store.stream`).

    sinks : prompt head + first document tokens; chunk : tokens per forward; budget : zoomed
    tokens per (layer, KV head); window : tokens kept waiting at full resolution (at least);
    bounded : a book's store, pre-RoPE, its chunks at positions within the model window.
    """

    sinks: int
    chunk: int
    budget: int
    window: int
    bounded: bool
    rope: Rope
    band_end: int  # bounded: the first position of the waiting tokens (sinks + budget)

    @classmethod
    def plan(cls, source: StoreSource) -> StreamLayout:
        """The layout of streaming ``source``'s context; SekvError when the model window is
        too small."""
        loaded, context, settings = source.loaded, source.context, source.settings
        spec, stream = loaded.spec, settings.stream
        sinks = n_sinks(len(context), context.doc_start, settings.segment)
        bounded = exceeds_window(spec.window, len(context))
        # bounded positions must fit the model window: small windows get smaller chunks/budget
        small = spec.window // 8 if bounded else max(settings.prefill_chunk, stream.budget)
        chunk, budget = min(settings.prefill_chunk, small), min(stream.budget, small)
        room = spec.window - (sinks + budget) - 2 * chunk - 1
        window = min(stream.window, room) if bounded else stream.window
        if window < max(chunk, settings.segment.max_len):
            raise SekvError(
                f"the model's {spec.window:,}-token window is too small to stream this document "
                f"(its prompt head takes {sinks} tokens); use a model with a longer window"
            )
        return cls(sinks, chunk, budget, window, bounded, Rope(loaded.model), sinks + budget)

    @property
    def mode(self) -> str:
        return "bounded" if self.bounded else "original"

    def frame(
        self, keys_pre: torch.Tensor, start: int, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Keys as the store keeps fixed keys and the sketch: pre-RoPE when bounded,
        else post-RoPE at their original positions (``positions``, or from ``start`` on)."""
        if self.bounded:
            return keys_pre
        if positions is None:
            positions = torch.arange(start, start + keys_pre.shape[2])
        return self.rope.rotate(keys_pre, positions)
