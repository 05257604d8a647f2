"""Held-out evaluation of a router, and the score that selects the weights a run keeps."""

from __future__ import annotations

import torch

from ..models import LoadedModel
from ..zoom.zoomnet import ZoomNet
from .examples import Example, PreparedDoc
from .losses import budget_tokens, kl_to_teacher, step_mass
from .settings import TrainSettings
from .student import answer_steps, step_decisions, student_forward
from .teacher import zoom_targets


@torch.no_grad()
def evaluate(
    loaded: LoadedModel,
    net: ZoomNet,
    docs: list[PreparedDoc],
    held: list[Example],
    s: TrainSettings,
) -> dict[str, float]:
    """Held-out figures at each budget share: KL to the teacher, and recall of the teacher's
    target spans by the answer-time decisions (per layer, KV head and answer step: the union of
    the targets of the step's mined positions over the group's heads)."""
    out = {}
    for share in s.eval_shares:
        kl, hits, wanted, covered, mass_total = 0.0, 0, 0, 0.0, 0.0
        for ex in held:
            doc = docs[ex.doc]
            budget = budget_tokens(doc, share)
            doc.memory.place_sketch()  # held-out figures route with the whole sketch
            logits, gates = student_forward(loaded, net, doc, ex, budget)
            kl += float(kl_to_teacher(logits, ex))
            z = torch.stack(gates)  # (L, Hkv, G, Tq, N)
            L, Hkv, G, Tq, N = z.shape
            steps = answer_steps(Tq, ex.answer_len, z.device)
            lengths = doc.memory.lengths
            decision = torch.stack(
                [step_decisions(z[i], steps, lengths, budget)[1] for i in range(L)]
            )
            mined, targets = zoom_targets(ex.mass.to(z.device), s.rho)
            want = (targets & mined[..., None]).view(L, Hkv, G, Tq, N).any(2)  # (L, Hkv, Tq, N)
            index = steps[None, None, :, None].expand_as(want)
            per_step = torch.zeros(decision.shape, device=z.device)  # (L, Hkv, P, N)
            want = per_step.scatter_reduce(2, index, want.float(), "amax") > 0
            hits += int((decision & want).sum())
            wanted += int(want.sum())
            mass = step_mass(ex, z.shape, z.device)
            covered += float((mass * decision).sum())
            mass_total += float(mass.sum())
        n = max(len(held), 1)
        out[f"kl@{share}"] = round(kl / n, 4)
        out[f"target_recall@{share}"] = round(hits / max(wanted, 1), 4)
        # share of the teacher's attention on spans that the zoom decisions cover
        out[f"mass_recall@{share}"] = round(covered / max(mass_total, 1e-12), 4)
    return out


def held_out_score(metrics: dict[str, float]) -> float:
    """Model selection: the mean KL to the teacher over the evaluated budget shares."""
    kls = [v for k, v in metrics.items() if k.startswith("kl@")]
    return sum(kls) / max(len(kls), 1)
