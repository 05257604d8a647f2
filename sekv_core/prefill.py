"""SeKV prefill: one chunked forward pass that captures every layer's K/V and each surprisal."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .backend import use_attention
from .sketch import QueryMoments
from .surprisal import Surprisal

Progress = Callable[[int, int], None]
"""progress(done_tokens, total_tokens) during context prefill."""


@dataclass
class Prefill:
    """What one pass over the context yields.

    keys, values : (L, H_kv, T, D) tensors on CPU (post-RoPE keys, at original positions)
    surprisal : (T,) float32, -log p(x_t | x_<t) in nats (0 for the first token)
    query_moment : (L, H_kv, D, D) mean q q^T of each KV head group's queries (the sketch's
    weighting, see :mod:`sekv_core.sketch`)
    """

    keys: torch.Tensor
    values: torch.Tensor
    surprisal: np.ndarray
    query_moment: torch.Tensor | None = None


MOMENTS = "sekv_moments"  # attention implementation: sdpa that also records query moments


def _attention_with_moments(module, query, key, value, attention_mask, **kwargs):
    kwargs.pop(MOMENTS).add(module.layer_idx, query[0], key.shape[1])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@torch.inference_mode()
def prefill(model, ids: list[int], chunk: int = 512, progress: Progress | None = None) -> Prefill:
    """Run ``ids`` through ``model`` in chunks of ``chunk`` tokens.

    The log-probability of each realised next token comes from the chunk's last hidden states
    (:class:`sekv_core.surprisal.Surprisal`, a few rows of logits over the vocabulary at a time:
    a chunk's whole [chunk, vocab] logits would be the build's largest tensor). The queries'
    second moments are summed on the way (attention runs as sdpa).
    """
    moments = QueryMoments()
    device = next(model.parameters()).device
    decoder, nll = model.get_decoder(), Surprisal(model.get_output_embeddings())
    cache = DynamicCache(config=model.config)
    surprisal = np.zeros(len(ids), dtype=np.float32)
    token_ids = torch.tensor(ids, device=device)
    prev = None  # (hidden,) the last hidden state of the previous chunk
    # sdpa's own mask: a custom name gets none (wrong causality)
    with use_attention(model, MOMENTS, _attention_with_moments, mask=sdpa_mask):
        for start in range(0, len(ids), chunk):
            piece = token_ids[start : start + chunk]
            out = decoder(input_ids=piece[None], cache=cache, use_cache=True, sekv_moments=moments)
            hidden = out.last_hidden_state[0]  # (c, hidden)
            if prev is not None:
                hidden, targets, offset = torch.cat([prev[None], hidden]), piece, start
            else:
                targets, offset = piece[1:], 1
            prev = hidden[-1]
            surprisal[offset : offset + len(targets)] = nll(hidden, targets).cpu().numpy()
            if progress:
                progress(min(start + chunk, len(ids)), len(ids))
    keys, values = host_kv(cache)
    return Prefill(keys, values, surprisal, moments.moment())


def host_kv(cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's K, V as (L, H, T, D) host tensors, each layer's freed once copied (the
    build's peak memory holds one copy of the document's K/V, not two)."""
    layers = cache.layers
    shape = (len(layers), *layers[0].keys.shape[1:])
    keys = torch.empty(shape, dtype=layers[0].keys.dtype)
    values = torch.empty(shape, dtype=layers[0].values.dtype)
    for i, layer in enumerate(layers):
        keys[i], values[i] = layer.keys[0], layer.values[0]
        layer.keys = layer.values = None
        release_freed_memory()
    return keys, values


def release_freed_memory() -> None:
    """Hand freed heap memory back to the system (glibc's ``malloc_trim``; elsewhere nothing):
    a layer's freed cache would otherwise stay in the process, next to the copy being filled."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()
