"""Answering methods behind one interface; ``METHODS`` maps CLI names to classes."""

from .base import Method, MethodSettings
from .blocks import BlockRetrieval
from .chunkkv import ChunkKV
from .full import FullKV
from .h2o import H2O
from .sekv import SeKV
from .sekv_trained import SeKVTrained
from .snapkv import SnapKV
from .static import StaticSemantic
from .streaming import StreamingLLM
from .window import Retrieve, Truncate

METHODS: dict[str, type[Method]] = {
    m.name: m
    for m in (
        SeKV,
        SeKVTrained,
        FullKV,
        StreamingLLM,
        H2O,
        SnapKV,
        ChunkKV,
        StaticSemantic,
        BlockRetrieval,
        Retrieve,
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
    "ChunkKV",
    "FullKV",
    "H2O",
    "SeKV",
    "SeKVTrained",
    "SnapKV",
    "StreamingLLM",
]
