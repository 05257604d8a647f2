"""The sinks' keys and values, recomputed when a store is loaded rather than stored.

A store's sinks are the context's first tokens (the prompt head and the document's first few,
:mod:`sekv_core.segment`), and their keys and values depend on those tokens alone. So a store
of original positions does not keep their rows: a load runs them through the model (30 tokens
for the default model: ~0.13 s on one CPU thread) and quantises them to the 8-bit rows answers
hold (:mod:`sekv_core.kvquant`), as the build did with the rows of its whole-context pass.
That is 0.011 of a 1,200-token story's fp16 cache. The numbers can differ from the build's in
the last bits of a float (the same tokens in a shorter pass); they are what every load of the
store answers with. A bounded store (a book) keeps its sinks: they are stored pre-RoPE in
fp16, rotated at load. The build leaves them out of the file (:func:`sekv_core.format.on_disk`).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .format import FIXED_SCALES, RECOMPUTED
from .kvquant import quantize_rows
from .prefill import host_kv
from .summary import STORE_DTYPE, one_thread

__all__ = ["RECOMPUTED", "restore_sinks", "sink_rows"]


@torch.inference_mode()
def sink_rows(model, ids: list[int]) -> dict[str, torch.Tensor]:
    """The 8-bit rows (:data:`~sekv_core.format.FIXED_SCALES`' names) of the keys and values
    (post-RoPE, at positions 0..) of the context's first tokens ``ids``."""
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    with one_thread():  # the same numbers at every load, whatever the threads
        model.get_decoder()(input_ids=torch.tensor([ids], device=device), cache=cache)
    keys, values = host_kv(cache)
    out = {}
    for (name, scale), rows in zip(FIXED_SCALES.items(), (keys, values), strict=True):
        out[name], out[scale] = quantize_rows(rows.to(STORE_DTYPE))
    return out


def restore_sinks(resident: dict[str, torch.Tensor], model, ids: list[int]) -> None:
    """The sinks' rows recomputed (:func:`sink_rows` of the context's first tokens) and put in
    front of the stored fixed rows, in place, where the store does not keep them; ValueError
    where the marker does not fit the store."""
    marker = resident.pop(RECOMPUTED, None)
    if marker is None:
        return
    if marker.numel() != 1 or not 0 < int(marker) <= len(ids):
        raise ValueError("the recomputed sinks' count does not fit the context")
    rows = sink_rows(model, ids[: int(marker)])
    for name, computed in rows.items():
        stored = resident[name]
        if stored.shape[:2] != computed.shape[:2] or stored.shape[3:] != computed.shape[3:]:
            raise ValueError(f"{name} does not fit the model's sinks")
        resident[name] = torch.cat([computed.to(stored.dtype), stored], dim=2)
