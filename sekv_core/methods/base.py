"""The interface every answering method implements (full KV, baselines, SeKV are peers)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..decode import PositionedStep
from ..documents import Document
from ..models import LoadedModel
from ..prefill import Progress
from ..prompt import Context
from ..zoom import KV_BITS


@dataclass
class MethodSettings:
    """Settings shared by methods; each method reads the ones it understands."""

    budget: int | None = None  # reconstructed tokens allowed per (layer, KV head)
    # resident-memory target as a share of the context's full KV cache counted at fp16 (the
    # bench holds every method to the same share); a method turns it into its own knob
    memory_ratio: float | None = None
    prefill_chunk: int = 512
    # "none" (= "sketch"), "summary", "oracle": training-free; "auto": the trained router for
    # the model (the user's, else the shipped one) if any; else a router file from `sekv train`.
    # Training-free here, so that the benchmarks' "sekv" is the training-free peer of
    # "sekv-trained"; `sekv ask` and `sekv chat` pass "auto" (docs/benchmarks.md, ninth pass).
    router: str = "none"
    # non-zoomed spans' summaries in the softmax: measured, they help on generated needle
    # haystacks (14/15 vs 9/15) but hurt real documents (sample QA 9/18 vs 12/18): off by default
    use_summaries: bool = False
    measure_recall: bool = False  # run the oracle router alongside and report routing recall
    # token-level K/V on the device (zoomed spans, sinks, anchors): 8 (int8 + scale) or 16
    kv_bits: int = KV_BITS
    warn: Callable[[str], None] | None = None  # told about stale stores being rebuilt
    extra: dict[str, Any] = field(default_factory=dict)


class Method(ABC):
    """Holds a document's context memory and answers questions from it.

    ``prepare`` builds the memory once (prefill, or load a stored one); ``generate`` may be called
    many times, each question starting from the same memory.
    """

    name: ClassVar[str]
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
        self, loaded: LoadedModel, document: Document, context: Context, settings: MethodSettings
    ) -> None:
        self.loaded = loaded
        self.document = document
        self.context = context
        self.settings = settings

    @abstractmethod
    def prepare(self, progress: Progress | None = None) -> None: ...

    @abstractmethod
    def generate(self, question_ids: list[int], max_new_tokens: int) -> Iterator[int]:
        """Greedy answer tokens for a question appended to the context."""

    def memory(self) -> dict[str, int]:
        """resident_bytes / offloaded_bytes this method holds for the document.

        ``resident_fp16_bytes`` counts what the method keeps resident at 2 bytes per number: the
        bench compares it with the fp16 full KV cache, so that methods computing in fp32 on a
        CPU and methods storing fp16 are held to one scale.
        """
        return {"resident_bytes": 0, "resident_fp16_bytes": 0, "offloaded_bytes": 0}

    def zoom_trace(self) -> list[dict[str, Any]]:
        """Spans zoomed for the last answer (empty for methods without spans)."""
        return []

    def routing(self) -> dict[str, Any]:
        """How the last answer routed (router, budget, recall vs the oracle); empty if n/a."""
        return {}

    def store_info(self) -> dict[str, Any]:
        """Where the method's persistent memory lives, and whether it was a cache hit."""
        return {"path": None, "cache_hit": False}
