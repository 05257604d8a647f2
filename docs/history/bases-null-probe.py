"""Fidelity of format 13's store under null perturbations of its 8-bit bases (tenth study):
the same code, its numbers rounded otherwise. How far the every-span figures move when
nothing but rounding changes.

    eigh64     the eigenvectors computed in float64 instead of float32 (a few 8-bit numbers
               round the other way)
    levels126  each column's grid has codes within ±126 instead of ±127 (every number rounds
               anew, at the same precision)

Run with format 13's tree first on PYTHONPATH (one thread, one SEKV_HOME per mode):
    SEKV_HOME=/tmp/h-null python bases-null-probe.py eigh64 bench fidelity --methods sekv \
        --tasks needle,multikey,qa --lengths 2000,4000 --depths 0.25,0.75 --seeds 1 \
        --every-span --threads 1
"""

import sys

import torch

MODE = sys.argv.pop(1)
if MODE == "eigh64":
    _eigh = torch.linalg.eigh

    def eigh64(x, *args, **kwargs):
        vals, vecs = _eigh(x.double(), *args, **kwargs)
        return vals.to(x.dtype), vecs.to(x.dtype)

    torch.linalg.eigh = eigh64
elif MODE == "levels126":
    import sekv_core.narrow

    sekv_core.narrow.LEVELS = 126
else:
    raise SystemExit(f"unknown mode {MODE!r}")
import sekv_cli.main  # noqa: E402

sekv_cli.main.app(prog_name="sekv")
