"""A streamed build's state between two chunks (:class:`StreamState`) and its checkpoints
(:class:`Checkpoints`), kept beside its part files: how a rerun resumes
(:mod:`sekv_core.store.stream`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from ..locks import STATE_VERSION
from ..segment import SINK, SPAN
from ..sketch import QueryMoments, SketchBasis, sketch_from_state, sketch_state
from .format import manifest_digest, sha256
from .resident import CODEBOOKS
from .tensorfile import read_tensors

KV = ("pending_k", "pending_v", "sink_k", "sink_v")  # the state's K/V, on the model's device


@dataclass
class StreamState:
    """The stream between two chunks: what a checkpoint holds besides the parts. The waiting
    tokens are [commit_end, next): read, not committed yet."""

    next: int
    commit_end: int
    threshold: float  # the segmentation threshold of the last commit
    pending_k: torch.Tensor  # (L, H, W, D) the waiting tokens' keys, pre-RoPE
    pending_v: torch.Tensor
    sink_k: torch.Tensor  # (L, H, n, D) the sinks'
    sink_v: torch.Tensor
    surprisal: np.ndarray  # (T,) of every context token read so far
    roles: np.ndarray  # (T,)
    sketch_basis: SketchBasis | None = None  # fixed at the first commit
    moments: QueryMoments = field(default_factory=QueryMoments)  # the queries seen until then
    code: dict[str, torch.Tensor] | None = None  # the offload codes' CODEBOOKS, as fixed then

    @classmethod
    def start(
        cls,
        tokens: int,
        sinks: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> StreamState:
        """Nothing read of ``tokens`` context tokens, the first ``sinks`` of them sinks; K/V of
        ``shape`` (L, H, D)."""
        L, H, D = shape
        none = torch.zeros(L, H, 0, D, dtype=dtype, device=device)  # (the sinks': the 1st chunk's)
        roles = np.full(tokens, SPAN, dtype=np.int8)
        roles[:sinks] = SINK
        return cls(0, sinks, 0.0, none, none, none, none, np.zeros(tokens, np.float32), roles)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint saves (CPU)."""
        return {
            **{name: getattr(self, name).cpu() for name in KV},
            "surprisal": torch.from_numpy(self.surprisal),
            "roles": torch.from_numpy(self.roles),
            **sketch_state(self.sketch_basis, self.moments),
            **(self.code or {}),
        }

    @classmethod
    def restore(
        cls, counters: dict[str, Any], t: dict[str, torch.Tensor], device: torch.device
    ) -> StreamState:
        """The state a checkpoint saved: its ``counters`` and :meth:`tensors`, K/V to ``device``."""
        basis, moments = sketch_from_state(t)
        return cls(
            next=counters["next"],
            commit_end=counters["commit_end"],
            threshold=counters["threshold"],
            **{name: t[name].to(device) for name in KV},
            surprisal=t["surprisal"].numpy().copy(),
            roles=t["roles"].numpy().copy(),
            sketch_basis=basis,
            moments=moments,
            code={name: t[name] for name in CODEBOOKS if name in t} if CODEBOOKS[0] in t else None,
        )


class CheckpointInvalid(Exception):
    """A checkpoint that does not verify (another store's or version, damaged, missing)."""


class Checkpoints:
    """The checkpoints of the build of ``store`` in its work directory ``work``.

    Each writes the state's tensors to a new ``state-<ms>.safetensors``, then replaces
    ``state.json`` (counters, the checksums of those tensors and of every part) atomically: a
    crash at any point leaves the last complete checkpoint. ``document``, the document's
    absolute path, is recorded for `sekv stores list` to name the interrupted ingest.
    """

    def __init__(self, work: Path, store: str, document: str | None = None) -> None:
        self.work, self.store, self.document = work, store, document

    def write(self, state: StreamState, parts: list[dict[str, Any]]) -> None:
        """Checkpoint ``state`` after the ``parts`` committed so far."""
        name = f"state-{int(time.time() * 1000)}.safetensors"
        tensors = state.tensors()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(self.work / name))
        record = {
            "version": STATE_VERSION,
            "store": self.store,
            "document": self.document,
            "next": state.next,
            "commit_end": state.commit_end,
            "threshold": state.threshold,
            "parts": parts,
            "tensors": {"name": name, "sha256": sha256(self.work / name)},
        }
        record["digest"] = manifest_digest(record)  # a flipped count is never resumed from
        tmp = self.work / "state.json.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.work / "state.json")
        for old in self.work.glob("state-*.safetensors"):
            if old.name != name:
                old.unlink(missing_ok=True)

    def read(self, device: torch.device) -> tuple[StreamState, list[dict[str, Any]]] | None:
        """The last checkpoint's state (K/V on ``device``) and parts; None when there is none.
        Raises CheckpointInvalid unless its version, store, digest and every checksum match."""
        file = self.work / "state.json"
        if not file.exists():
            return None
        try:
            record = json.loads(file.read_text())
            ok = record.get("version") == STATE_VERSION and record.get("store") == self.store
            ok = ok and record.get("digest") == manifest_digest(record)
            files = [*record["parts"], record["tensors"]]
            ok = ok and all(sha256(self.work / f["name"]) == f["sha256"] for f in files)
            if not ok:
                raise ValueError("checkpoint does not match")
            tensors = read_tensors(self.work / record["tensors"]["name"])
        except Exception as exc:  # also safetensors' own errors on a damaged file
            raise CheckpointInvalid(str(exc)) from exc
        return StreamState.restore(record, tensors, device), record["parts"]

    def clean(self) -> None:
        """Drop parts and checkpoints."""
        for file in self.work.iterdir():
            file.unlink(missing_ok=True)
