"""Answering methods behind one interface; ``METHODS`` maps CLI names to classes."""

from .base import Method, MethodSettings
from .full import FullKV

METHODS: dict[str, type[Method]] = {FullKV.name: FullKV}

__all__ = ["METHODS", "Method", "MethodSettings", "FullKV"]
