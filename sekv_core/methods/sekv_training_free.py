"""SeKV with the training-free router always: each span's best logit estimated from its
routing sketch, the top spans zoomed under the token budget
(:class:`sekv_core.zoom.router.SketchRouter`). A benchmark peer of :mod:`.sekv_trained`."""

from __future__ import annotations

from .sekv import SeKV


class SeKVTrainingFree(SeKV):
    name = "sekv-training-free"

    def uses_trained_router(self) -> bool:
        return False
