"""Answering methods behind one interface; ``METHODS`` maps CLI names to classes."""

from .base import Method, MethodSettings
from .full import FullKV
from .sekv import SeKV
from .sekv_free import SeKVTrainingFree

METHODS: dict[str, type[Method]] = {m.name: m for m in (SeKV, SeKVTrainingFree, FullKV)}

__all__ = ["METHODS", "Method", "MethodSettings", "FullKV", "SeKV", "SeKVTrainingFree"]
