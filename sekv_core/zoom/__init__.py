"""The zoom memory: what answering reads of a span store, and how each layer attends to it.

- :mod:`.memory` — :class:`~.memory.SpanMemory`, a store's resident tier on the model's device;
  hands out zoomed spans' token-level K/V.
- :mod:`.router` — which spans to zoom, per layer and KV head (training-free rule or the trained
  gate of :mod:`.zoomnet`); :mod:`.prefilter` narrows the candidates on long documents.
- :mod:`.reconstruct` — token-level K/V of (span, head) pairs from the offload tier's records.
- :mod:`.pools` — the zoomed tokens of one layer, in slots later steps reuse.
- :mod:`.attention` — the mixed-resolution attention inside the model (one softmax).
- :mod:`.trace` — what the router did during one answer.
- :mod:`.chunks` — a streamed build's chunks, read through the zoom into the store grown so far.

On the CPU each decode step's work is one native call (:mod:`sekv_core.native.kernels`).
"""
