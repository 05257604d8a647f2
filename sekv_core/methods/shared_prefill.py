"""One context's full prefill kept for the next method that reads the same context.

The eviction baselines (:mod:`.eviction`) all start from the context's full KV cache and the
attention mass its prefill accumulated; a benchmark that runs several of them, at several memory
shares, over one document prefills it once when it hands each session the same
:class:`PrefillSlot`. A session given none prefills on its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

from ..models import LoadedModel


@dataclass
class FullPrefill:
    """The context's full KV cache and the attention mass its prefill accumulated."""

    cache: DynamicCache
    mass: torch.Tensor  # (L, H_kv, T) float32, CPU
    length: int


class PrefillSlot:
    """Holds the :class:`FullPrefill` of the last context asked for (one slot: asking for
    another context frees it before the new one is built)."""

    def __init__(self) -> None:
        self.key: tuple[str, ...] | None = None
        self.full: FullPrefill | None = None

    def get(
        self, loaded: LoadedModel, ids: list[int], build: Callable[[], FullPrefill]
    ) -> tuple[FullPrefill, bool]:
        """The prefill of ``ids`` read by ``loaded`` (built by ``build`` unless held); and
        whether it was held."""
        digest = hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()
        key = (loaded.fingerprint, str(loaded.device), str(loaded.dtype), digest)
        if self.key == key and self.full is not None:
            return self.full, True
        self.clear()  # free the previous context's cache before building this one
        self.full, self.key = build(), key
        return self.full, False

    def clear(self) -> None:
        """Let go of the held prefill (its memory is freed once no method holds it)."""
        self.key, self.full = None, None
