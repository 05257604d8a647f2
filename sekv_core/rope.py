"""Rotary position embedding helpers: keys are compressed *before* RoPE and rotated at use.

RoPE rotates each key by an angle proportional to its position, which spreads a span's keys over
more directions, so the store codes span keys pre-RoPE; reconstruction rotates them back to their
positions with the model's own rotary tables (``model.model.rotary_emb``), so attention sees the
same post-RoPE keys as the full cache. Llama / Mistral / Qwen2 / Qwen3 use the rotate-half
convention.
"""

from __future__ import annotations

import torch

from .native import kernels


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


STATIC_ROPE = ("default", "linear", "llama3")  # rotary types whose angles depend on position only
TABLE_STEP = 256  # a table of positions grows by whole steps


class Rope:
    """cos/sin tables of a model for arbitrary positions."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.rotary = model.model.rotary_emb
        self.static = getattr(self.rotary, "rope_type", "default") in STATIC_ROPE
        self.limit = getattr(model.config, "max_position_embeddings", None) or 1 << 20
        self._table: torch.Tensor | None = None  # cos | sin (n, 2D) of positions 0..n-1

    def tables(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """cos, sin of shape (T, D) for ``positions`` (T,), in ``like``'s dtype and device.
        Host positions of a static rotary type read a table of every position so far (grown
        as needed: no model call per zoom); others ask the model's rotary embedding."""
        if not (self.static and positions.device.type == "cpu" and positions.numel()):
            cos, sin = self.rotary(like, positions.to(like.device)[None])
            return cos[0].to(like.dtype), sin[0].to(like.dtype)
        table = self.table(int(positions.max()) + 1, like)
        both = table.index_select(0, positions.to(like.device))  # one row gather for both
        half = table.shape[1] // 2
        return both[:, :half], both[:, half:]

    def table(self, need: int, like: torch.Tensor) -> torch.Tensor:
        """cos | sin (n, 2D) of positions 0 .. n - 1, n >= ``need`` (static rotary types), in
        ``like``'s dtype and device."""
        table = self._table
        stale = table is None or table.device != like.device or table.dtype != like.dtype
        if stale or table.shape[0] < need:
            size = -(-need // TABLE_STEP) * TABLE_STEP  # whole steps: few regrowths
            size = max(need, min(size, self.limit))  # never past the model's positions
            every = torch.arange(size, device=like.device)[None]
            cos, sin = self.rotary(like.new_zeros((), dtype=torch.float), every)
            table = self._table = torch.cat([cos[0], sin[0]], dim=1).to(like.dtype)
        return table

    def rotate(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys (..., T, D) -> post-RoPE at ``positions`` (T,). Rows (T, D) of a static
        rotary type on the CPU rotate in one native call (:mod:`sekv_core.native.kernels`), with the
        same products and sums."""
        if (
            self.static
            and k.dim() == 2
            and k.dtype == torch.float32
            and positions.dtype == torch.long
            and positions.numel()
            and kernels.usable(k, positions)
        ):
            return kernels.rotate(k, positions, self.table(int(positions.max()) + 1, k))
        cos, sin = self.tables(positions, k)
        return k * cos + rotate_half(k) * sin

    def shift(self, x: torch.Tensor, by: int) -> torch.Tensor:
        """Post-RoPE vectors (..., D) at any positions -> at those positions + ``by`` (negative:
        back): one rotation by ``by`` positions' angles (the rotary scaling left out)."""
        cos, sin = self.tables(torch.tensor([abs(by)]), x)  # (1, D)
        norm = (cos.square() + sin.square()).sqrt()  # attention_scaling (1 for plain RoPE)
        sin = sin if by >= 0 else -sin
        return (x * cos + rotate_half(x) * sin) / norm

    def unrotate(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys (..., T, D) at ``positions`` -> pre-RoPE (inverse rotation)."""
        cos, sin = self.tables(positions, k)
        scale = cos.square() + sin.square()  # attention_scaling^2 (1 for plain RoPE)
        return (k * cos - rotate_half(k) * sin) / scale
