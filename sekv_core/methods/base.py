"""The interface every answering method implements (full KV, baselines, SeKV are peers)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from ..config import MethodSettings
from ..decode import Forcing, PositionedStep
from ..documents import Document
from ..models import LoadedModel
from ..prefill import Progress
from ..prompt import Context
from ..sampling import Sampling
from .shared_prefill import PrefillSlot


class Method(ABC):
    """Holds a document's context memory and answers questions from it.

    ``prepare`` builds the memory once (prefill, or load a stored one); ``generate`` may be called
    many times, each question starting from the same memory. ``prefills``: a slot shared with
    other sessions over the same context (:mod:`.shared_prefill`; methods that prefill the
    full cache may reuse it).
    """

    name: ClassVar[str]
    follows_memory_share: ClassVar[bool] = True  # resident memory follows ``memory_share``
    reads_books: ClassVar[bool] = False  # answers contexts beyond the model's window
    step: PositionedStep | None = None  # the last answer's decoding step (methods that use one)

    @property
    def local_tokens(self) -> int:
        """Question + answer tokens the last answer fed (its local window)."""
        return self.step.fed if self.step is not None else 0

    @property
    def max_position(self) -> int:
        """The largest RoPE position the last answer used."""
        return self.step.last_position if self.step is not None else 0

    def __init__(
        self,
        loaded: LoadedModel,
        document: Document,
        context: Context,
        settings: MethodSettings,
        prefills: PrefillSlot | None = None,
    ) -> None:
        self.loaded = loaded
        self.document = document
        self.context = context
        self.settings = settings
        self.prefills = prefills

    @abstractmethod
    def prepare(self, progress: Progress | None = None) -> None: ...

    @abstractmethod
    def generate(
        self,
        question_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling | None = None,
        forcing: Forcing | None = None,
    ) -> Iterator[int]:
        """Answer tokens for a question appended to the context: greedy, or under
        ``sampling``; ``forcing`` feeds given tokens and records the log-probabilities
        (:func:`sekv_core.decode.decode_tokens`)."""

    def question_position(self) -> int:
        """RoPE position of the question's first token: the window left after it is the
        question's and the answer's (methods reading books keep it within the window)."""
        return len(self.context)

    def memory(self) -> dict[str, int]:
        """resident_bytes / offloaded_bytes this method holds for the document (at most, over
        the last answer).

        Resident K/V count at 2 bytes per number, as the fp16 full KV cache every memory share
        divides by: methods computing in fp32 on a CPU and methods storing fp16 or 8-bit rows
        are held to one scale.
        """
        return {"resident_bytes": 0, "offloaded_bytes": 0}

    def zoom_trace(self) -> list[dict[str, Any]]:
        """Spans zoomed for the last answer (empty for methods without spans)."""
        return []

    def answer_attention(self) -> torch.Tensor | None:
        """(L, H_kv, T): the most attention one query predicting a token of the last answer
        paid each context token, per layer and KV head (:mod:`sekv_core.sources`), or None for
        methods that do not record it."""
        return None

    def explain(self, start: int, end: int) -> dict[str, Any]:
        """What the method did for context tokens [start, end) during the last answer, in terms
        a reader follows (SeKV: layers zoomed, the router's rank); empty if n/a."""
        return {}

    def routing(self) -> dict[str, Any]:
        """How the last answer routed (router, budget, ...); empty if n/a."""
        return {}

    def store_info(self) -> dict[str, Any]:
        """Where the method's persistent memory lives, and whether it was a cache hit."""
        return {"path": None, "cache_hit": False}
