"""Full KV: the reference method. The whole context's K/V stay resident."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import DynamicCache

from ..decode import greedy
from ..prompt import stop_ids
from .base import Method, Progress


def answer_over(loaded, cache: DynamicCache, question_ids: list[int], max_new_tokens: int):
    """Greedy answer token ids to ``question_ids`` over a full ``cache`` (it grows with them)."""
    model, device = loaded.model, loaded.device

    @torch.inference_mode()
    def step(ids: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids.to(device), cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    yield from greedy(step, question_ids, stop_ids(loaded.tokenizer), max_new_tokens)


class FullKV(Method):
    name = "full"
    follows_memory_share = False  # it holds the whole cache (the bench runs it once)

    cache: DynamicCache | None = None

    def prepare(self, progress: Progress | None = None) -> None:
        self.cache = prefill_cache(
            self.loaded.model, self.context.ids, self.settings.prefill_chunk, progress
        )

    def generate(self, question_ids: list[int], max_new_tokens: int) -> Iterator[int]:
        assert self.cache is not None, "prepare() first"
        truncate(self.cache, len(self.context))  # every question starts from the document alone
        yield from answer_over(self.loaded, self.cache, question_ids, max_new_tokens)

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
