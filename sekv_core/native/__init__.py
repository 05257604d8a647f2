"""The native room, below the store and the zoom: C code for the CPU's hot loops.

- :mod:`.build` — :func:`~.build.library`: ``zoomstep.c`` and ``rans.c`` compiled on first use
  with the system's compiler, loaded once; :func:`~.build.usable` says whether tensors can go in.
- :mod:`.kernels` — the decode step's kernels (``zoomstep.c``), one typed call each.
- ``rans.c`` — the offload tier's entropy coder, called by :mod:`sekv_core.store.entropy`.
- ``bitfields.h`` — where a packed code lies in a record (:mod:`sekv_core.bitpack`'s layout),
  read and written by both C sources.
"""
