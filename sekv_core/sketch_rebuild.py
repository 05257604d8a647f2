"""The routing sketch's rows, rebuilt when a store is loaded from the keys of its offload tier.

A sketch row is a projection of one span token's key (:mod:`sekv_core.sketch`), and the
offload tier already holds every span key in the key code. So the store on disk keeps only the
sketch's fixed-size parts (its query and key directions, the mean key, one scale per direction)
and no rows: at load every span key is decoded, rotated to its position (bounded stores keep
keys pre-RoPE, as their sketch does), projected and quantised at the stored scale. That leaves
16 bytes per span token and KV head off the disk (a 32-direction 4-bit sketch: 6% of an fp16 KV
cache). A decoded key differs from the exact one by the key code's error, which is far below
one sketch level, so the rows are those a build from the exact keys gives but for a few levels
at a rounding boundary.
"""

from __future__ import annotations

import torch

from .codec import Code
from .rope import Rope
from .sketch import pack_sketch


def sketch_rows_from_keys(
    resident: dict[str, torch.Tensor],
    key_records: torch.Tensor,
    code: Code,
    rope: Rope | None,
    bits: int,
) -> torch.Tensor:
    """The packed sketch (L, H, S, R / 2 or R) of a store's span keys.

    resident : the store's resident tensors (span bounds, ``part_rows``, ``sketch_key``,
    ``sketch_mean``, ``sketch_scale``); key_records : the offload tier's flat key bytes (per
    part (L, H, rows, record), parts one after another); code : the key code; rope : rotates
    the keys to their positions (None: the sketch is of pre-RoPE keys, a bounded store)."""
    proj = resident["sketch_key"].float()  # (L, H, D, R)
    mean = resident["sketch_mean"].float()  # (L, H, D)
    scale = resident["sketch_scale"].float()  # (L, H, R)
    L, H, _, R = proj.shape
    records = key_records.view(-1, code.record_bytes)
    index = record_index(resident["part_rows"], L, H)  # (L, H, S)
    S = index.shape[-1]
    positions = span_positions(resident["span_starts"], resident["span_ends"])
    top = 2 ** (bits - 1) - 1
    every = positions.repeat(H)  # the rows decode head after head
    layers = []
    for layer in range(L):  # one layer at a time: bounded working memory
        rows = records.index_select(0, index[layer].flatten())
        keys = code.decode(rows, layer, [S] * H, torch.float32)
        if rope is not None:
            keys = rope.rotate(keys, every)
        offset = mean[layer][:, None] @ proj[layer]  # (H, 1, R)
        sketch = torch.baddbmm(offset, keys.view(H, S, -1), proj[layer], alpha=1, beta=-1)
        levels = (sketch / scale[layer][:, None]).round_().clamp_(-top, top)  # (k - mu) B
        layers.append(pack_sketch(levels, bits))
    return torch.stack(layers)


def record_index(part_rows: torch.Tensor, layers: int, heads: int) -> torch.Tensor:
    """(L, H, S) the record number of every span row, per layer and KV head, rows in order: a
    part of n rows holds (L, H, n) records after the parts before it."""
    pieces = []
    for p in range(len(part_rows) - 1):
        first, n = int(part_rows[p]), int(part_rows[p + 1] - part_rows[p])
        base = layers * heads * first
        grid = torch.arange(layers * heads).view(layers, heads, 1) * n + torch.arange(n)
        pieces.append(base + grid)
    if not pieces:
        return torch.zeros(layers, heads, 0, dtype=torch.long)
    return torch.cat(pieces, dim=2)


def span_positions(starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """(S,) the context position of every span token, spans in order."""
    lengths = ends - starts
    first = torch.cumsum(lengths, 0) - lengths
    span = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return (starts[span] + torch.arange(int(lengths.sum())) - first[span]).long()
