"""A store file's tensors packed into one LZMA stream, losslessly.

A store's fixed costs are a few matrices per (layer, KV head): the codebooks' bases (8-bit
codes, :mod:`sekv_core.narrow`), the sketch's two projections (fp16), the anchors' rows
(8-bit), the codebooks' means and scales; and per token its trace (ids, offsets, pages). On a
short document they weigh most: 0.04 of the fp16 cache on a 1,200-token story. Their bytes
are not uniform (8-bit codes of near-Gaussian numbers; an fp16 number's high byte is sign,
exponent and two bits; offsets that grow by a few), so LZMA over them, each multi-byte
number's bytes grouped by place, keeps 0.8-0.9 of the matrices and a quarter of the trace.
The resident file and the trace file are written so, all but the sketch's fixes (already
compressed) and rows (a long book keeps them: tens of MB that hardly compress). A load
unpacks them bit for bit in a few tens of milliseconds; a stream that does not unpack to
exactly the shapes it names refuses the store.
"""

from __future__ import annotations

import lzma

import numpy as np
import torch

# tensors left as they are: the sketch's fixes (already LZMA-compressed) and rows (a long book
# keeps them: tens of MB of 4-bit codes, seconds of LZMA at every ingest for a few percent)
KEPT = ("sketch_fixes", "sketch")
BLOB = "packed"  # the LZMA stream (uint8)
SHAPE = "_packed"  # suffix of a packed tensor's [dtype code, *shape] (int64)
DTYPES = (
    torch.int8,
    torch.float16,
    torch.uint8,
    torch.float32,
    torch.int64,
    torch.int32,
    torch.int16,
)


def pack(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` in one LZMA stream (:data:`BLOB`; all but :data:`KEPT`, in name order), each
    named by its dtype and shape (``name + SHAPE``)."""
    out, pieces = dict(tensors), []
    for name in sorted(n for n in tensors if n not in KEPT):
        t = out.pop(name)
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}: {t.dtype} is not packed")
        pieces.append(_split(t.detach().cpu().contiguous()))
        out[name + SHAPE] = torch.tensor([DTYPES.index(t.dtype), *t.shape], dtype=torch.int64)
    if pieces:
        out[BLOB] = deflated(b"".join(pieces))
    return out


def unpack(tensors: dict[str, torch.Tensor]) -> None:
    """The tensors :func:`pack` packed, back in place; ValueError where the stream does not
    decompress to exactly the shapes it names."""
    names = sorted(name[: -len(SHAPE)] for name in tensors if name.endswith(SHAPE))
    if not names and BLOB not in tensors:
        return
    if BLOB not in tensors:
        raise ValueError("packed matrices without their stream")
    raw, at = inflated(tensors.pop(BLOB), "packed tensors"), 0
    for name in names:
        head = tensors.pop(name + SHAPE).tolist()
        if not head or not 0 <= head[0] < len(DTYPES) or any(d < 0 for d in head[1:]):
            raise ValueError(f"{name}: malformed packed shape")
        dtype, shape = DTYPES[head[0]], head[1:]
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if at + size > len(raw):
            raise ValueError(f"{name}: the packed stream is short")
        tensors[name] = _join(raw[at : at + size], dtype, shape)
        at += size
    if at != len(raw):
        raise ValueError("the packed stream holds more than its matrices")


def compress(t: torch.Tensor) -> torch.Tensor:
    """One tensor's bytes (grouped by place) as an LZMA stream (uint8)."""
    return deflated(_split(t.detach().cpu().contiguous()))


def decompress(blob: torch.Tensor, dtype: torch.dtype, count: int) -> torch.Tensor:
    """The 1-D tensor of ``count`` numbers :func:`compress` made; ValueError where ``blob``
    does not decompress to exactly that."""
    raw = inflated(blob, "a packed tensor's numbers")
    if len(raw) != count * dtype.itemsize:
        raise ValueError("a packed tensor does not hold the numbers it should")
    return _join(raw, dtype, [count])


def deflated(raw: bytes) -> torch.Tensor:
    """``raw`` as an LZMA stream (uint8)."""
    return torch.frombuffer(bytearray(lzma.compress(raw, preset=6)), dtype=torch.uint8)


def inflated(blob: torch.Tensor, what: str) -> bytes:
    """The bytes of the LZMA stream ``blob`` (uint8); ValueError, naming ``what`` it holds,
    where it is not one."""
    if blob.dtype != torch.uint8 or blob.dim() != 1:
        raise ValueError(f"{what} are not packed bytes")
    try:
        return lzma.decompress(blob.numpy().tobytes())
    except lzma.LZMAError as exc:
        raise ValueError(f"{what} do not unpack ({exc})") from None


def _split(t: torch.Tensor) -> bytes:
    """A matrix's bytes, a multi-byte number's bytes grouped by place (all low bytes first)."""
    raw = t.view(torch.uint8).numpy().reshape(-1, t.element_size())
    return raw.T.tobytes()


def _join(raw: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    width = dtype.itemsize
    grouped = np.frombuffer(raw, dtype=np.uint8).reshape(width, -1).T.copy()
    return torch.from_numpy(grouped.reshape(-1)).view(dtype).reshape(shape)
