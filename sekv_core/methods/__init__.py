"""Answering methods behind one interface; ``METHODS`` maps CLI names to classes."""

from .base import Method, MethodSettings
from .full import FullKV
from .sekv import SeKV

METHODS: dict[str, type[Method]] = {SeKV.name: SeKV, FullKV.name: FullKV}

__all__ = ["METHODS", "Method", "MethodSettings", "FullKV", "SeKV"]
