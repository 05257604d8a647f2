"""Attention implementations plugged into transformers by name, for the duration of a block.

transformers looks attention functions up by name (``AttentionInterface``) on every call; a
method registers its function when it uses it and switches the model to it inside a ``with``
block. Nothing is registered at import, and the model's own implementation comes back after.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface


@contextmanager
def use_attention(
    model: torch.nn.Module, name: str, forward: Callable, mask: Callable | None = None
) -> Iterator[None]:
    """Route ``model``'s attention through ``forward`` (registered as ``name``) in the block.

    ``mask``: the mask function transformers builds for it (custom names get none: a function
    without one applies causality itself). The switch walks every module, so it happens once per
    block, not per step.
    """
    AttentionInterface.register(name, forward)
    if mask is not None:
        AttentionMaskInterface.register(name, mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
