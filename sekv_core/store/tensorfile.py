"""Reading safetensors files: the one reader of every file a store or its build writes.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and byte range in the data that follows) and the data. :func:`file_header` reads and
checks the header; tensors are then read as copies (:func:`read_tensors`, one ``pread`` each),
memory-mapped as read-only views (:func:`map_tensors`: an offload tier's coding, a finished
build's part records), or their bytes read range by range (a growing store's records:
:class:`~sekv_core.store.partial.PartFiles`). Sources are a path or a file open for binary
reading (a verified descriptor: what was checked is what is read).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
Source = Path | BinaryIO


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: ``dtype``, ``shape`` and its bytes ``[start, stop)`` in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    stop: int


def file_header(f: BinaryIO) -> dict[str, Entry]:
    """The tensors of the open file ``f`` by name, their byte ranges absolute. ValueError where
    the header is not a safetensors header of this file (a range outside its data, a size that
    is not its shape's, an unknown dtype)."""
    size = os.fstat(f.fileno()).st_size
    head = os.pread(f.fileno(), 8, 0)
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < length <= size - 8:
        raise ValueError("no safetensors header")
    header = json.loads(os.pread(f.fileno(), length, 8))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    data, out = 8 + length, {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[meta["dtype"]]
            shape = tuple(int(n) for n in meta["shape"])
            start, stop = (int(n) for n in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r}: not a safetensors entry") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if min(shape, default=0) < 0 or not 0 <= start <= stop <= size - data:
            raise ValueError(f"tensor {name!r}: bytes outside the file")
        if stop - start != nbytes:
            raise ValueError(f"tensor {name!r}: {stop - start} bytes for shape {list(shape)}")
        out[name] = Entry(dtype, shape, data + start, data + stop)
    return out


def read_tensors(source: Source, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """The tensors (``names``: only those; KeyError naming one the file lacks) of a file, as
    copies."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            return read_tensors(f, names)
    entries = file_header(source)
    wanted = entries if names is None else {name: entries[name] for name in names}
    out = {}
    for name, e in wanted.items():
        if e.start == e.stop:  # no bytes to read or map
            out[name] = torch.empty(e.shape, dtype=e.dtype)
            continue
        raw = bytearray(os.pread(source.fileno(), e.stop - e.start, e.start))
        out[name] = torch.frombuffer(raw, dtype=e.dtype).view(e.shape)
    return out


def map_tensors(source: Source, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """Memory-map the tensors (``names``: only those) of a file as read-only torch views of
    their shapes (no copy; the maps stay valid after the file is replaced or deleted)."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            return map_tensors(f, names)
    out = {}
    for name, e in file_header(source).items():
        if names is not None and name not in names:
            continue
        if e.start == e.stop:  # no bytes to read or map
            out[name] = torch.zeros(e.shape, dtype=e.dtype)
            continue
        raw = np.memmap(source, dtype=np.uint8, mode="r", offset=e.start, shape=e.stop - e.start)
        with warnings.catch_warnings():  # read-only map: torch warns it is not writable
            warnings.simplefilter("ignore")
            out[name] = torch.from_numpy(raw).view(e.dtype).view(e.shape)
    return out
