"""An offload code for entropy-coded stores: one even grid per (layer, KV head), every direction.

:mod:`sekv_core.allocated` spends a fixed number of bits per row: each direction's grid spans
its document range at the bits it was given, so a direction whose range is set by a few
outlying rows codes every other row coarsely, and its codes crowd the middle levels. A store
that is entropy-coded on disk (:mod:`sekv_core.rans`) pays about the codes' entropy instead,
and there the better code at a given error puts *one* step on every direction of a head:
strong directions get many levels, weak ones a few or none, and rare outlying codes cost
only their own bits. On the handbook's keys at step 0.175: 3.1 bits per number on disk at a
lower attention error than ``alloc:4.5``'s 3.5 bits. Values keep ``*x4``: attention reads
small-norm values most, and its row scale keeps their relative error
(docs/history/compact-store-study.md, eighth study).

Spec ``"even:S"``: the step is S times the head's root-mean-square coefficient (in the keys'
query metric; values: plain). Each direction's bits (shared by a layer's heads, 2 to 8; 0
drops a direction whose every code would be 0) hold the document's largest code, so no row is
clipped; a direction that would need more than 8 bits keeps 8 on a grid over its range. The
record is the widest layer's bits, in whole bytes. The code is an :class:`AllocatedCode`
(decoded alike); ``step`` (L, H) marks it in a store and keeps each head's step.
"""

from __future__ import annotations

import torch

from .allocated import AllocatedCode, metric_directions
from .summary import stored
from .tiers import MAX_BITS

MARK = "step"  # the codebook part that marks an even code: each head's step (L, H)


def fit_even(rows: torch.Tensor, relative_step: float, metric: torch.Tensor) -> AllocatedCode:
    """The even code of rows (L, H, S, D) in ``metric`` (L, H, D), its step ``relative_step``
    times each head's root-mean-square coefficient."""
    x, metric = rows.float(), stored(metric)
    L, H, S, D = x.shape
    if S == 0:  # no rows: any code of the right shape (one byte of unused bits)
        eye = torch.eye(D).expand(L, H, D, D).contiguous()
        zeros, ones = x.new_zeros(L, H, D), x.new_ones(L, H, D)
        bits = torch.zeros(L, H, D, dtype=torch.long)
        return AllocatedCode(eye, metric, zeros, ones, bits, 8, x.new_zeros(L, H))
    mean = stored(x.mean(dim=2))
    scale = metric.sqrt()
    bases, peaks, steps, needed, bits = [], [], [], [], []
    for layer in range(L):  # one layer at a time: bounded working memory
        basis, coef = metric_directions(x[layer], mean[layer], scale[layer])
        step = relative_step * coef.square().mean(dim=(1, 2)).sqrt().clamp(min=1e-6)  # (H,)
        peak = coef.abs().amax(dim=1)  # (H, D)
        levels = torch.ceil(peak / step[:, None] - 0.5).clamp(min=0)  # largest code needed
        need = torch.where(levels > 0, torch.log2(2 * levels + 1).ceil().clamp(min=2), 0.0)
        bases.append(basis)
        peaks.append(peak)
        steps.append(step)
        needed.append(levels)
        bits.append(need.amax(dim=0).clamp(max=MAX_BITS).long())  # (D,) the heads' layout
    layout = torch.stack(bits)[:, None].expand(L, H, D)
    step, peak = torch.stack(steps), torch.stack(peaks)
    top = torch.where(layout >= 2, 2 ** (layout - 1).clamp(min=1) - 1, 0).float()
    fits = top >= torch.stack(needed)  # else 8 bits on a grid over the range
    span = stored(torch.where(fits, top * step[..., None], peak).clamp(min=1e-6))
    return AllocatedCode(
        torch.stack(bases), metric, mean, span, layout, row_bits(layout), stored(step)
    )


def row_bits(bits: torch.Tensor) -> int:
    """A record's bits for the layout ``bits`` (L, H, D): the widest layer's, in whole bytes."""
    widest = int(bits[:, 0].sum(dim=-1).max()) if bits.numel() else 0
    return max(8, -(-widest // 8) * 8)
