"""The interface every answering method implements (full KV, baselines, SeKV are peers)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..models import LoadedModel
from ..prompt import Context

Progress = Callable[[int, int], None]
"""progress(done_tokens, total_tokens) during context prefill."""


@dataclass
class MethodSettings:
    """Settings shared by methods; each method reads the ones it understands."""

    budget: int | None = None  # tokens of token-level KV allowed beyond the always-kept ones
    prefill_chunk: int = 512
    extra: dict[str, Any] = field(default_factory=dict)


class Method(ABC):
    """Holds a document's context memory and answers questions from it.

    ``prepare`` builds the memory once (prefill, or load a stored one); ``generate`` may be called
    many times, each question starting from the same memory.
    """

    name: ClassVar[str]

    def __init__(self, loaded: LoadedModel, context: Context, settings: MethodSettings) -> None:
        self.loaded = loaded
        self.context = context
        self.settings = settings

    @abstractmethod
    def prepare(self, progress: Progress | None = None) -> None: ...

    @abstractmethod
    def generate(self, question_ids: list[int], max_new_tokens: int) -> Iterator[int]:
        """Greedy answer tokens for a question appended to the context."""

    def memory(self) -> dict[str, int]:
        """resident_bytes / offloaded_bytes this method holds for the document."""
        return {"resident_bytes": 0, "offloaded_bytes": 0}

    def zoom_trace(self) -> list[dict[str, Any]]:
        """Spans zoomed for the last answer (empty for methods without spans)."""
        return []

    def store_info(self) -> dict[str, Any]:
        """Where the method's persistent memory lives, and whether it was a cache hit."""
        return {"path": None, "cache_hit": False}
