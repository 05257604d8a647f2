"""Answering methods behind one interface; ``METHODS`` maps CLI names to classes.

``sekv ask`` offers ``sekv``, ``full`` and ``retrieve``; the others are benchmark peers
(``sekv bench``): SeKV's training-free and trained routers alone, the eviction baselines,
static summaries, block retrieval and truncation.
"""

from .base import Method, MethodSettings
from .blocks import BlockRetrieval
from .chunkkv import ChunkKV
from .full import FullKV
from .h2o import H2O
from .sekv import SeKV
from .sekv_trained import SeKVTrained
from .sekv_training_free import SeKVTrainingFree
from .shared_prefill import PrefillSlot
from .snapkv import SnapKV
from .static import StaticSemantic
from .streaming import StreamingLLM
from .window import Retrieve, Truncate

METHODS: dict[str, type[Method]] = {
    m.name: m
    for m in (
        SeKV,
        FullKV,
        Retrieve,
        SeKVTrainingFree,
        SeKVTrained,
        StreamingLLM,
        H2O,
        SnapKV,
        ChunkKV,
        StaticSemantic,
        BlockRetrieval,
        Truncate,
    )
}

__all__ = [
    "METHODS",
    "BlockRetrieval",
    "Retrieve",
    "Truncate",
    "StaticSemantic",
    "Method",
    "MethodSettings",
    "PrefillSlot",
    "ChunkKV",
    "FullKV",
    "H2O",
    "SeKV",
    "SeKVTrained",
    "SeKVTrainingFree",
    "SnapKV",
    "StreamingLLM",
]
