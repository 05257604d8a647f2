"""Full KV: the reference method. The whole context's K/V stay resident.

With ``settings.sources`` the answer runs through :func:`attributed_attention`: sdpa as usual,
plus the attention the query predicting each answer token pays the context (its sources).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from ..backend import use_attention
from ..decode import Forcing, decode_tokens
from ..prompt import stop_ids
from ..sampling import Sampling
from .base import Method, Progress

ATTRIBUTED = "sekv_attributed"


def attributed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    sekv_answer: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention that also keeps, in ``sekv_answer`` (L, H_kv, T), the most attention the last
    query paid each of the first T keys, per layer and KV head (its group's query heads summed
    / all query heads, as SeKV's trace counts it). The last query sees every key (no mask).

    A decoding step (one query) computes its probabilities once and uses them for the output
    too; a longer input (the question) runs sdpa, plus the last query's probabilities.
    """
    if sekv_answer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    _, Hq, Tq, D = query.shape
    Hkv, T = key.shape[1], sekv_answer.shape[2]
    scaling = kwargs.get("scaling") or D**-0.5
    q = query[0, :, -1].view(Hkv, Hq // Hkv, D)
    probs = (torch.einsum("hgd,htd->hgt", q, key[0]).float() * scaling).softmax(-1)
    layer = sekv_answer[module.layer_idx]
    torch.maximum(layer, probs[..., :T].sum(dim=1) / Hq, out=layer)
    if Tq > 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = torch.einsum("hgt,htd->hgd", probs.to(value.dtype), value[0])  # (Hkv, G, D)
    return out.reshape(1, 1, Hq, D), None


def answer_over(
    loaded,
    cache: DynamicCache,
    question_ids: list[int],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    forcing: Forcing | None = None,
    attention: torch.Tensor | None = None,
):
    """Answer token ids to ``question_ids`` over a full ``cache`` (it grows with them), chosen
    as :func:`~sekv_core.decode.decode_tokens` does; ``attention`` (L, H_kv, T): see
    :func:`attributed_attention`."""
    model, device = loaded.model, loaded.device
    extra = {} if attention is None else {"sekv_answer": attention}

    @torch.inference_mode()
    def step(ids: torch.Tensor) -> torch.Tensor:
        out = model(
            input_ids=ids.to(device), cache=cache, use_cache=True, logits_to_keep=1, **extra
        )
        return out.logits[:, -1].float()

    stop = stop_ids(loaded.tokenizer)
    yield from decode_tokens(step, question_ids, stop, max_new_tokens, sampling, forcing)


def attention_buffer(loaded, tokens: int) -> torch.Tensor:
    """(L, H_kv, tokens) zeros on the model's device, for :func:`answer_attributed` to fill."""
    spec = loaded.spec
    return torch.zeros(spec.num_layers, spec.num_kv_heads, tokens, device=loaded.device)


def answer_attributed(
    loaded,
    cache: DynamicCache,
    question_ids: list[int],
    max_new_tokens: int,
    sampling: Sampling | None,
    forcing: Forcing | None,
    attention: torch.Tensor,
) -> Iterator[int]:
    """:func:`answer_over` through :func:`attributed_attention`: ``attention`` (L, H_kv, T)
    keeps the most attention a query predicting an answer token paid each of the first T
    cached tokens (the answer's sources)."""
    with use_attention(loaded.model, ATTRIBUTED, attributed_attention, mask=sdpa_mask):
        yield from answer_over(
            loaded, cache, question_ids, max_new_tokens, sampling, forcing, attention
        )


class FullKV(Method):
    name = "full"
    follows_memory_share = False  # it holds the whole cache (the bench runs it once)

    cache: DynamicCache | None = None
    attention: torch.Tensor | None = None  # (L, H_kv, T) the last answer's (settings.sources)

    def prepare(self, progress: Progress | None = None) -> None:
        self.cache = prefill_cache(
            self.loaded.model, self.context.ids, self.settings.prefill_chunk, progress
        )

    def generate(
        self,
        question_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling | None = None,
        forcing: Forcing | None = None,
    ) -> Iterator[int]:
        assert self.cache is not None, "prepare() first"
        truncate(self.cache, len(self.context))  # every question starts from the document alone
        if not self.settings.sources:
            self.attention = None
            yield from answer_over(
                self.loaded, self.cache, question_ids, max_new_tokens, sampling, forcing
            )
            return
        self.attention = attention_buffer(self.loaded, len(self.context))
        yield from answer_attributed(
            self.loaded, self.cache, question_ids, max_new_tokens, sampling, forcing, self.attention
        )

    def answer_attention(self) -> torch.Tensor | None:
        return self.attention

    def memory(self) -> dict[str, int]:
        spec, n = self.loaded.spec, len(self.context)
        return {
            "resident_bytes": spec.kv_bytes(n, 2),
            "offloaded_bytes": 0,
        }


@torch.inference_mode()
def prefill_cache(
    model, ids: list[int], chunk: int, progress: Progress | None = None
) -> DynamicCache:
    """Run ``ids`` through ``model`` in chunks (bounded attention memory); return the KV cache."""
    cache = DynamicCache(config=model.config)
    device = next(model.parameters()).device
    for start in range(0, len(ids), chunk):
        piece = torch.tensor([ids[start : start + chunk]], device=device)
        model(input_ids=piece, cache=cache, use_cache=True, logits_to_keep=1)
        if progress:
            progress(min(start + chunk, len(ids)), len(ids))
    return cache


def truncate(cache: DynamicCache, length: int) -> None:
    """Drop cached positions beyond ``length`` (transformers >= 5.24: crop takes -count)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)
