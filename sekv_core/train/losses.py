"""The training objective of one example: what the router is optimised for.

Loss = KL(teacher || student) on the answer tokens + ``w_order`` * listwise ranking loss of each
answer-time decision against the teacher's span mass + ``w_zoom`` * zoom BCE on mined positions
(positives up-weighted) + ``w_budget`` * expected share of context tokens zoomed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..methods.sekv import MIN_ZOOM
from ..models import LoadedModel
from ..zoom.zoomnet import ZoomNet, step_best
from .examples import Example, PreparedDoc
from .settings import TrainSettings
from .student import answer_steps, student_forward
from .teacher import MINE_MASS, zoom_targets


def losses(
    loaded: LoadedModel,
    net: ZoomNet,
    doc: PreparedDoc,
    ex: Example,
    s: TrainSettings,
    share: float | None = None,
) -> dict[str, torch.Tensor]:
    """Every loss term of one example (see the module docstring); ``share``: the zoom budget
    as a share of span tokens (default: drawn from ``s.budget_shares``)."""
    if share is None:
        share = float(torch.empty(()).uniform_(*s.budget_shares))
    half = share < s.half_sketch_below and bool(torch.rand(()) < 0.5)
    doc.memory.place_sketch(doc.memory.sketch_dims // 2 if half else None)
    logits, gates = student_forward(loaded, net, doc, ex, budget_tokens(doc, share))
    kl = kl_to_teacher(logits, ex)
    z = torch.stack(gates)  # (L, Hkv, G, Tq, N)
    L, Hkv, G, Tq, N = z.shape
    order = order_loss(z, ex)
    z = z.reshape(L, Hkv * G, Tq, N)
    mined, targets = zoom_targets(ex.mass.to(z.device), s.rho)
    if mined.any():
        zm, tm = z[mined], targets[mined].float()  # (M, N)
        pos = tm.sum().clamp(min=1)
        weight = ((tm.numel() - pos) / pos).clamp(max=20.0)
        bce = F.binary_cross_entropy_with_logits(zm, tm, pos_weight=weight)
    else:
        bce = z.sum() * 0
    lengths = doc.memory.lengths.float()
    budget = (torch.sigmoid(z) * lengths).sum(-1).mean() / doc.context_len
    total = kl + s.w_order * order + s.w_zoom * bce + s.w_budget * budget
    return {
        "loss": total,
        "kl": kl,
        "order": order,
        "zoom_bce": bce,
        "budget": budget,
    }


def budget_tokens(doc: PreparedDoc, share: float) -> int:
    """A zoom budget of ``share`` of the document's span tokens (at least the ``MIN_ZOOM``
    tokens answering zooms under any memory target; spans that do not fit are skipped)."""
    return max(MIN_ZOOM, int(share * int(doc.memory.lengths.sum())))


def kl_to_teacher(logits: torch.Tensor, ex: Example) -> torch.Tensor:
    """KL(teacher || student) over the answer positions (batch mean)."""
    return F.kl_div(
        logits.log_softmax(-1),
        ex.teacher_logp.to(logits.device),
        log_target=True,
        reduction="batchmean",
    )


def step_mass(ex: Example, shape: tuple[int, ...], device) -> torch.Tensor:
    """Teacher span mass per answer-time decision: (L, Hkv, P, N), summed over the group's
    heads and the step's positions (what one zoom decision serves)."""
    L, Hkv, G, Tq, N = shape
    steps = answer_steps(Tq, ex.answer_len, device)
    mass = ex.mass.to(device).view(L, Hkv, G, Tq, N).sum(2)  # (L, Hkv, Tq, N)
    out = mass.new_zeros(L, Hkv, int(steps.max()) + 1, N)
    return out.index_add_(2, steps, mass)


def order_loss(z: torch.Tensor, ex: Example) -> torch.Tensor:
    """Listwise ranking loss of the decisions: per (layer, KV head, step), KL from the teacher's
    span-mass distribution to softmax of the decision's gate logits. Under a token budget the
    decision zooms the best spans first, so their order is what answering depends on."""
    L, Hkv, G, Tq, N = z.shape
    steps = answer_steps(Tq, ex.answer_len, z.device)
    best = torch.stack([step_best(z[i], steps) for i in range(L)])  # (L, Hkv, P, N)
    mass = step_mass(ex, z.shape, z.device)  # (L, Hkv, P, N)
    total = mass.sum(-1)
    counted = total >= MINE_MASS * G  # decisions whose heads reach far back
    if not counted.any():
        return z.sum() * 0
    target = mass[counted] / total[counted][:, None]
    logp = best[counted].log_softmax(-1)
    return (target * (target.clamp(min=1e-12).log() - logp)).sum(-1).mean()
