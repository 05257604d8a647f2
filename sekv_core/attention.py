"""Mixed-resolution attention, plugged into transformers through its AttentionInterface.

For the question tokens and every generated token, each layer attends in ONE softmax over:

    [ sinks + anchors | summaries of non-zoomed spans (+ log|S|) | zoomed spans' tokens | local ]

where *local* is the question + generated tokens (full resolution, in an ordinary cache). A span
that is zoomed for a KV head contributes its reconstructed tokens to that head and its summary
to none; others contribute one summary entry whose logit gets + log|S| so it weighs like |S|
similar tokens (optional: ``use_summaries``). Batched over heads and spans.

The implementation is registered under the name ``"sekv"``; :func:`sekv_attention` switches a
model to it for the duration of a block. Keys are stored post-RoPE at their original positions,
and local tokens take positions after the context, so nothing is re-rotated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from .router import Router, select
from .zoom import SpanMemory, ZoomTrace

NAME = "sekv"


@dataclass
class ZoomPolicy:
    """How one answer routes: router, token budget per (layer, KV head), threshold margin."""

    router: Router
    budget: int = 256
    margin: float = 6.0
    use_summaries: bool = False
    oracle: Router | None = None  # when set: measure routing recall against it
    trace: ZoomTrace = field(default_factory=ZoomTrace)


def mixed_attention(
    q: torch.Tensor,
    k_local: torch.Tensor,
    v_local: torch.Tensor,
    k_mem: torch.Tensor,
    v_mem: torch.Tensor,
    bias_mem: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over memory entries and the causal local window.

    q : (Hkv, G, Tq, D); k_local, v_local : (Hkv, Tl, D), the last Tq of which are the queries';
    k_mem, v_mem : (Hkv, M, D); bias_mem : (Hkv, M) additive logit bias (-inf = absent).
    Returns the output (Hkv, G, Tq, D) and the attention mass of each memory entry summed over
    the group's heads and the queries (Hkv, M).
    """
    Tq, Tl = q.shape[2], k_local.shape[1]
    logits_mem = torch.einsum("hgtd,hmd->hgtm", q, k_mem).float() * scaling
    logits_mem = logits_mem + bias_mem[:, None, None, :].float()
    logits_loc = torch.einsum("hgtd,hld->hgtl", q, k_local).float() * scaling
    visible = (
        torch.arange(Tl, device=q.device)[None]
        <= torch.arange(Tl - Tq, Tl, device=q.device)[:, None]
    )  # (Tq, Tl)
    logits_loc = logits_loc.masked_fill(~visible, float("-inf"))
    probs = torch.cat([logits_mem, logits_loc], dim=-1).softmax(dim=-1).to(q.dtype)
    M = k_mem.shape[1]
    out = torch.einsum("hgtm,hmd->hgtd", probs[..., :M], v_mem) + torch.einsum(
        "hgtl,hld->hgtd", probs[..., M:], v_local
    )
    return out, probs[..., :M].float().sum(dim=(1, 2))


def sekv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sekv_memory: SpanMemory | None = None,
    sekv_policy: ZoomPolicy | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query (1, Hq, Tq, D), key/value (1, Hkv, Tl, D) local."""
    if sekv_memory is None or sekv_policy is None:
        raise RuntimeError("sekv attention called without sekv_memory / sekv_policy")
    memory, policy, layer = sekv_memory, sekv_policy, module.layer_idx
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    _, Hq, Tq, D = query.shape
    Hkv = key.shape[1]
    q = query[0].view(Hkv, Hq // Hkv, Tq, D)  # (Hkv, G, Tq, D)

    scores = policy.router.scores(memory, layer, q, scaling)  # (Hkv, N)
    zoom, threshold = select(scores, memory.lengths, policy.budget, policy.margin)
    policy.trace.record(layer, memory.num_layers, zoom, scores, threshold, memory.lengths)
    if policy.oracle is not None:
        best = policy.oracle.scores(memory, layer, q, scaling)
        want, _ = select(best, memory.lengths, policy.budget, policy.margin)
        policy.trace.add_recall(zoom, want)

    pool_k, pool_v, owner = memory.zoom_pool(layer, zoom)  # (Hkv, P, D), owner (Hkv, P)
    neg_inf = torch.finfo(torch.float32).min
    pool_bias = torch.where(owner >= 0, 0.0, neg_inf)  # (Hkv, P): padding is absent
    if policy.use_summaries:
        summary_bias = torch.where(zoom, neg_inf, memory.log_len[None].float())  # (Hkv, N)
    else:
        summary_bias = torch.full_like(zoom, neg_inf, dtype=torch.float32)
    fixed_k, fixed_v = memory.fixed_k[layer], memory.fixed_v[layer]  # (Hkv, F, D)
    k_mem = torch.cat([fixed_k, memory.summary_k[layer], pool_k], dim=1).to(q.dtype)
    v_mem = torch.cat([fixed_v, memory.summary_v[layer], pool_v], dim=1).to(q.dtype)
    bias = torch.cat(
        [fixed_k.new_zeros(Hkv, fixed_k.shape[1], dtype=torch.float32), summary_bias, pool_bias],
        dim=1,
    )
    out, mass = mixed_attention(q, key[0], value[0], k_mem, v_mem, bias, scaling)
    pool_mass = mass[:, mass.shape[1] - owner.shape[1] :] / (Hq * Tq)  # (Hkv, P)
    policy.trace.add_mass(owner, pool_mass, memory.n_spans)
    return out.reshape(Hq, Tq, D).transpose(0, 1)[None].contiguous(), None  # (1, Tq, Hq, D)


AttentionInterface.register(NAME, sekv_attention_forward)


@contextmanager
def sekv_attention(model: torch.nn.Module) -> Iterator[None]:
    """Route the model's attention through :func:`sekv_attention_forward` inside the block."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
