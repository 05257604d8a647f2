"""SeKV prefill: one chunked forward pass that captures every layer's K/V and each surprisal."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

Progress = Callable[[int, int], None]
"""progress(done_tokens, total_tokens) during context prefill."""


@dataclass
class Prefill:
    """What one pass over the context yields.

    keys, values : (L, H_kv, T, D) tensors on CPU (post-RoPE keys, at original positions)
    surprisal : (T,) float32, -log p(x_t | x_<t) in nats (0 for the first token)
    """

    keys: torch.Tensor
    values: torch.Tensor
    surprisal: np.ndarray


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) in nats for logits (T, V) and realised tokens (T,)."""
    pred = logits.float()
    return torch.logsumexp(pred, -1) - pred.gather(1, targets[:, None])[:, 0]


@torch.inference_mode()
def prefill(model, ids: list[int], chunk: int = 512, progress: Progress | None = None) -> Prefill:
    """Run ``ids`` through ``model`` in chunks of ``chunk`` tokens.

    Only one chunk's logits ([chunk, vocab]) exist at a time: the log-probability of each
    realised next token is gathered chunk by chunk.
    """
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    surprisal = np.zeros(len(ids), dtype=np.float32)
    token_ids = torch.tensor(ids, device=device)
    prev_logits = None  # (vocab,) logits of the last token of the previous chunk
    for start in range(0, len(ids), chunk):
        piece = token_ids[start : start + chunk]
        logits = model(input_ids=piece[None], cache=cache, use_cache=True).logits[0]  # (c, V)
        if prev_logits is not None:
            logits = torch.cat([prev_logits[None], logits])  # predicts piece[0] first
            targets = piece
            offset = start
        else:
            targets = piece[1:]
            offset = 1
        nll = token_nll(logits[: len(targets)], targets)  # (c,)
        surprisal[offset : offset + len(targets)] = nll.cpu().numpy()
        prev_logits = logits[-1]
        if progress:
            progress(min(start + chunk, len(ids)), len(ids))
    keys = torch.stack([layer.keys[0] for layer in cache.layers]).cpu()  # (L, H, T, D)
    values = torch.stack([layer.values[0] for layer in cache.layers]).cpu()
    return Prefill(keys, values, surprisal)
