"""Token eviction: the shared base of the StreamingLLM / H2O / SnapKV / ChunkKV baselines.

An eviction method prefills the context with the full KV cache, decides which ``k`` context
tokens each (layer, KV head) keeps, and answers from a cache holding only those (post-RoPE) K/V.
The question and answer tokens take positions after ``len(context)``, so RoPE distances stay
those of the full prompt although the cache holds fewer entries (transformers builds its causal
mask from the cache length, which is right here: every kept entry precedes every new token).

Statistics come from a capture attention function (registered as ``"sekv_capture"``): ordinary
causal attention that also adds up, per (layer, KV head), the attention probability each key
receives (summed over the queries and the group's query heads), a few query rows at a time.

The context prefill (full cache + accumulated attention) comes from the session's
:class:`~.shared_prefill.PrefillSlot` when it is given one: every eviction method at every
budget over one document then prefills it once (a benchmark's sessions share a slot).
Question-aware methods (SnapKV, ChunkKV) keep that full prefill on the side and score each
question against it (one forward of the question over the full cache, then cropped back); their
resident figure is the compressed cache, and the question is re-read over the compressed cache
like every method's.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import DynamicCache

from ..backend import use_attention
from ..decode import Forcing, PositionedStep, decode_tokens
from ..models import LoadedModel
from ..prompt import stop_ids
from ..sampling import Sampling
from .base import Method, MethodSettings, Progress
from .full import truncate
from .shared_prefill import FullPrefill, PrefillSlot

CAPTURE = "sekv_capture"
SINK_DOC_TOKENS = 4  # document tokens after the prompt head that count as attention sinks
DEFAULT_SHARE = 0.2  # context share kept when neither memory_share nor budget is set
ROW_ELEMENTS = 1 << 24  # logits computed at once by the capture attention (64 MiB at fp32)


@dataclass
class AttentionStats:
    """What an eviction policy can score with; each tensor is (L, H_kv, T) float32 on CPU.

    prefill : attention each context token received from every context query during prefill
    window : attention each context token received from the question tokens (question-aware
        methods only, else None)
    """

    prefill: torch.Tensor
    window: torch.Tensor | None = None


class _Capture:
    """Per-call state of the capture attention: the (L, H_kv, T_total) mass being summed."""

    def __init__(self, num_layers: int, num_kv_heads: int, total: int, device) -> None:
        self.mass = torch.zeros(num_layers, num_kv_heads, total, device=device)


def capture_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sekv_capture: _Capture | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention that also sums each key's attention probability into ``sekv_capture``.

    query (1, Hq, Tq, D); key/value (1, Hkv, Tk, D) whose last Tq entries are the queries' own.
    transformers passes no mask to a custom function: causality (and a sliding window, if the
    model has one) is applied here.
    """
    if sekv_capture is None:
        raise RuntimeError("capture attention called without sekv_capture")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    _, Hq, Tq, D = query.shape
    Hkv, Tk = key.shape[1], key.shape[2]
    q = query[0].view(Hkv, Hq // Hkv, Tq, D)  # (Hkv, G, Tq, D)
    k, v = key[0], value[0]  # (Hkv, Tk, D)
    mass = sekv_capture.mass[module.layer_idx]  # (Hkv, T_total)
    out = torch.empty_like(q)
    cols = torch.arange(Tk, device=q.device)
    rows = max(1, ROW_ELEMENTS // (Hq * Tk))
    for r0 in range(0, Tq, rows):
        qb = q[:, :, r0 : r0 + rows]  # (Hkv, G, b, D)
        pos = torch.arange(r0, r0 + qb.shape[2], device=q.device) + (Tk - Tq)  # (b,)
        hidden = cols[None] > pos[:, None]  # (b, Tk): future keys
        if sliding_window is not None:
            hidden |= cols[None] <= pos[:, None] - sliding_window
        logits = torch.einsum("hgtd,hkd->hgtk", qb, k).float() * scaling  # (Hkv, G, b, Tk)
        probs = logits.masked_fill_(hidden, float("-inf")).softmax(dim=-1)
        mass[:, :Tk] += probs.sum(dim=(1, 2)).to(mass.device)  # layers may sit elsewhere
        out[:, :, r0 : r0 + rows] = torch.einsum("hgtk,hkd->hgtd", probs.to(v.dtype), v)
    return out.view(Hq, Tq, D).transpose(0, 1)[None].contiguous(), None  # (1, Tq, Hq, D)


def capture_attention(model: torch.nn.Module):
    """Route the model's attention through :func:`capture_attention_forward` inside the block."""
    return use_attention(model, CAPTURE, capture_attention_forward)


@torch.inference_mode()
def prefill_with_mass(
    loaded: LoadedModel, ids: list[int], chunk: int, progress: Progress | None = None
) -> FullPrefill:
    """Prefill ``ids`` in chunks with full KV, summing the attention every key receives."""
    model, spec, device = loaded.model, loaded.spec, loaded.device
    cache = DynamicCache(config=model.config)
    capture = _Capture(spec.num_layers, spec.num_kv_heads, len(ids), device)
    with capture_attention(model):
        for start in range(0, len(ids), chunk):
            piece = torch.tensor([ids[start : start + chunk]], device=device)
            model(
                input_ids=piece, cache=cache, use_cache=True, logits_to_keep=1, sekv_capture=capture
            )
            if progress:
                progress(min(start + chunk, len(ids)), len(ids))
    return FullPrefill(cache, capture.mass.cpu(), len(ids))


@torch.inference_mode()
def window_mass(loaded: LoadedModel, full: FullPrefill, question_ids: list[int]) -> torch.Tensor:
    """(L, H_kv, T) attention the question tokens pay each context token over the full cache.

    The question's K/V are cropped off afterwards: ``full`` is left as it was.
    """
    model, spec, device = loaded.model, loaded.spec, loaded.device
    n = len(question_ids)
    capture = _Capture(spec.num_layers, spec.num_kv_heads, full.length + n, device)
    positions = torch.arange(full.length, full.length + n, device=device)[None]
    try:
        with capture_attention(model):
            model(
                input_ids=torch.tensor([question_ids], device=device),
                position_ids=positions,
                cache=full.cache,
                use_cache=True,
                logits_to_keep=1,
                sekv_capture=capture,
            )
    finally:
        truncate(full.cache, full.length)
    return capture.mass[..., : full.length].cpu()


def context_prefill(
    loaded: LoadedModel,
    ids: list[int],
    chunk: int,
    progress: Progress | None = None,
    slot: PrefillSlot | None = None,
) -> FullPrefill:
    """The context's :class:`FullPrefill`: the one ``slot`` holds for the same model and
    context, else a new prefill (kept in ``slot`` for the next method)."""
    if slot is None:
        return prefill_with_mass(loaded, ids, chunk, progress)
    full, held = slot.get(loaded, ids, lambda: prefill_with_mass(loaded, ids, chunk, progress))
    if held and progress:
        progress(len(ids), len(ids))
    return full


@torch.inference_mode()
def gather_cache(config: Any, full: DynamicCache, keep: torch.Tensor) -> DynamicCache:
    """A new cache holding, per layer and KV head, the entries ``keep`` (L, H_kv, k) names."""
    cache = DynamicCache(config=config)
    for layer, (src, idx) in enumerate(zip(full.layers, keep, strict=True)):
        index = idx.to(src.keys.device)[None, :, :, None].expand(-1, -1, -1, src.keys.shape[-1])
        cache.update(src.keys.gather(2, index), src.values.gather(2, index), layer)
    return cache


def kept_tokens(settings: MethodSettings, length: int, sinks: int) -> int:
    """Context tokens kept per (layer, KV head): ``memory_share`` x T, else ``budget``, else 20%."""
    if settings.memory_share is not None:
        k = round(settings.memory_share * length)
    elif settings.budget is not None:
        k = settings.budget
    else:
        k = round(DEFAULT_SHARE * length)
    return min(length, max(sinks, k))


class EvictionMethod(Method):
    """Answers from a cache that keeps ``kept_tokens`` context tokens per (layer, KV head).

    Subclasses implement :meth:`keep`; ``question_aware`` ones are given the question's
    attention (``stats.window``) and compress once per question.
    """

    question_aware: ClassVar[bool] = False

    kept_tokens: int = 0
    full: FullPrefill | None = None  # held only by question-aware methods
    cache: DynamicCache | None = None
    kept: torch.Tensor | None = None  # (L, H_kv, k) context indices of the last compression

    @abstractmethod
    def keep(self, stats: AttentionStats) -> torch.Tensor:
        """(L, H_kv, k) sorted indices of the context tokens each layer and KV head keeps."""

    @property
    def sinks(self) -> int:
        """The prompt head and the first document tokens (StreamingLLM's attention sinks)."""
        return min(len(self.context), self.context.doc_start + SINK_DOC_TOKENS)

    def everywhere(self, indices: torch.Tensor) -> torch.Tensor:
        """(k,) indices -> (L, H_kv, k): the same tokens for every layer and KV head."""
        spec = self.loaded.spec
        return indices.expand(spec.num_layers, spec.num_kv_heads, -1)

    def prepare(self, progress: Progress | None = None) -> None:
        self.kept_tokens = kept_tokens(self.settings, len(self.context), self.sinks)
        chunk = self.settings.prefill_chunk
        full = context_prefill(self.loaded, self.context.ids, chunk, progress, self.prefills)
        if self.question_aware:
            self.full = full
        else:
            self.compress(full, AttentionStats(full.mass))

    def compress(self, full: FullPrefill, stats: AttentionStats) -> None:
        keep = self.keep(stats)
        spec = self.loaded.spec
        expected = (spec.num_layers, spec.num_kv_heads, self.kept_tokens)
        if tuple(keep.shape) != expected:
            raise RuntimeError(f"{self.name} kept {tuple(keep.shape)} entries, not {expected}")
        self.kept = keep
        self.cache = gather_cache(self.loaded.model.config, full.cache, keep)

    def generate(
        self,
        question_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling | None = None,
        forcing: Forcing | None = None,
    ) -> Iterator[int]:
        if self.question_aware:
            assert self.full is not None, "prepare() first"
            window = window_mass(self.loaded, self.full, question_ids)
            self.compress(self.full, AttentionStats(self.full.mass, window))
        assert self.cache is not None, "prepare() first"
        truncate(self.cache, self.kept_tokens)  # every question starts from the kept context
        model, cache, device = self.loaded.model, self.cache, self.loaded.device
        start = len(self.context)  # new tokens continue after the document's positions
        self.step = step = PositionedStep(model, cache, start, device)

        try:
            stop = stop_ids(self.loaded.tokenizer)
            yield from decode_tokens(step, question_ids, stop, max_new_tokens, sampling, forcing)
        finally:
            truncate(cache, self.kept_tokens)  # back to the kept context for the next question

    def memory(self) -> dict[str, int]:
        spec, k = self.loaded.spec, self.kept_tokens
        out = {
            "resident_bytes": spec.kv_bytes(k, 2),
            "offloaded_bytes": 0,
        }
        if self.question_aware:  # the full prefill each question is scored against
            out["scoring_kv_bytes"] = spec.kv_bytes(len(self.context), 2)
        return out

    def routing(self) -> dict[str, Any]:
        return {"kept_tokens": self.kept_tokens, "policy": self.name}
