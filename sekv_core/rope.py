"""Rotary position embedding helpers: keys are compressed *before* RoPE and rotated at use.

RoPE rotates each key by an angle proportional to its position, which spreads a span's keys over
more directions: pre-RoPE keys of a span are far more compressible (lower rank at the same error).
The store keeps span bases of pre-RoPE keys; reconstruction rotates them back to their positions
with the model's own rotary tables (``model.model.rotary_emb``), so attention sees the same
post-RoPE keys as the full cache. Llama / Mistral / Qwen2 / Qwen3 use the rotate-half convention.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rope:
    """cos/sin tables of a model for arbitrary positions."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.rotary = model.model.rotary_emb

    def tables(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """cos, sin of shape (T, D) for ``positions`` (T,), in ``like``'s dtype and device."""
        cos, sin = self.rotary(like, positions.to(like.device)[None])
        return cos[0].to(like.dtype), sin[0].to(like.dtype)

    def rotate(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys (..., T, D) -> post-RoPE at ``positions`` (T,)."""
        cos, sin = self.tables(positions, k)
        return k * cos + rotate_half(k) * sin

    def unrotate(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys (..., T, D) at ``positions`` -> pre-RoPE (inverse rotation)."""
        cos, sin = self.tables(positions, k)
        scale = cos.square() + sin.square()  # attention_scaling^2 (1 for plain RoPE)
        return (k * cos - rotate_half(k) * sin) / scale
