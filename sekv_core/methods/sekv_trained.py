"""SeKV with the trained zoom-in router (``sekv train``): the peer that shows what training adds.

In the library ``sekv`` routes training-free unless its settings name a router (the benchmarks'
``sekv`` is the training-free peer; ``sekv ask`` and ``sekv chat`` ask for ``auto``, the router
trained for the model when there is one); this method always uses a trained router and refuses
to run without one.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import SekvError
from ..router_files import RouterFile
from .sekv import SeKV


class SeKVTrained(SeKV):
    name = "sekv-trained"

    def __init__(self, loaded, document, context, settings) -> None:
        router = settings.router if settings.router != "sketch" else "auto"
        super().__init__(loaded, document, context, replace(settings, router=router))

    def router_choice(self) -> str:
        return self.settings.router  # a trained router, books included (the method's point)

    def trained_router(self) -> RouterFile | None:
        router = super().trained_router()
        if router is None:
            raise SekvError(
                f"no trained router fits {self.loaded.model_id}; train one with `sekv train` "
                "or use --method sekv"
            )
        return router
