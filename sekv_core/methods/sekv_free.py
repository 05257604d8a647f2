"""SeKV with training-free routing: the sketch router and its margin rule, never a trained gate.

The peer that shows what training adds (``sekv`` uses the trained router when one fits the model).
"""

from __future__ import annotations

from dataclasses import replace

from .sekv import SeKV


class SeKVTrainingFree(SeKV):
    name = "sekv-free"

    def __init__(self, loaded, document, context, settings) -> None:
        router = settings.router if settings.router in ("sketch", "summary", "oracle") else "none"
        super().__init__(loaded, document, context, replace(settings, router=router))
