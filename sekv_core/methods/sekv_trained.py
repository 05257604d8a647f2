"""SeKV with the trained zoom-in router (``sekv train``): the peer that shows what training adds.

``sekv`` routes training-free by default (measured: the shipped router lowers the teacher KL on
held-out generated documents but only ties with the training-free router on the benchmark's
needles and sample documents — see docs/benchmarks.md); this method always uses the router
trained for the model.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import SekvError
from ..zoomnet import RouterFile
from .sekv import SeKV


class SeKVTrained(SeKV):
    name = "sekv-trained"

    def __init__(self, loaded, document, context, settings) -> None:
        router = settings.router if settings.router not in ("none", "sketch") else "auto"
        super().__init__(loaded, document, context, replace(settings, router=router))

    def trained_router(self) -> RouterFile | None:
        router = super().trained_router()
        if router is None:
            raise SekvError(
                f"no trained router fits {self.loaded.model_id}; train one with `sekv train` "
                "or use --method sekv"
            )
        return router
