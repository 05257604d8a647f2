"""SeKV with a trained zoom-in router always (``sekv train``), books included; it refuses to
run without one. A benchmark peer: it shows what training adds beside
:mod:`.sekv_training_free`."""

from __future__ import annotations

from ..errors import SekvError
from ..router_files import RouterFile
from .sekv import SeKV


class SeKVTrained(SeKV):
    name = "sekv-trained"

    def uses_trained_router(self) -> bool:
        return True  # books too: the method's point

    def find_trained_router(self) -> RouterFile | None:
        router = super().find_trained_router()
        if router is None:
            raise SekvError(
                f"no trained router fits {self.loaded.model_id}; train one with `sekv train` "
                "or use the method sekv-training-free"
            )
        return router
