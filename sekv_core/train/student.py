"""The student: the frozen model answering through the gated zoom, differentiable in the gate.

The question + answer tokens run with a local cache only; every layer attends, in one softmax, to
the sinks/anchors, the span tokens the gate zooms (exact full-resolution K/V) and the local
tokens. The zoom decision is the answer-time one (per KV head, gate > 0, best first under a token
budget), hard in the forward pass, with gradients passed straight through (d hard / dz :=
d sigmoid(z) / dz), so distillation reaches the gate through the frozen model.

Causality: all context spans lie before every question/answer position, and each decision is taken
from the queries answering would have at that point: one decision for the whole question (its
prefill), then one per answer token from that token's own queries (a decoding step). A decision
never sees a later token's query — in particular not the answer's, which would let the gate find
the fact by its answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..backend import use_attention
from ..models import LoadedModel
from ..zoom.attention import NEIGHBOURS, widen
from ..zoom.memory import SpanMemory
from ..zoom.router import select
from ..zoom.zoomnet import ZoomNet, sketch_spans, step_best
from .examples import Example, PreparedDoc
from .teacher import causal_local

STUDENT = "sekv_student"


@dataclass
class StudentContext:
    """What the student's attention reads, and where it leaves its gate logits."""

    memory: SpanMemory
    net: ZoomNet
    span_k: list[torch.Tensor]  # per layer (Hkv, S, D) exact post-RoPE keys of span tokens
    span_v: list[torch.Tensor]
    span_id: torch.Tensor  # (S,) span of each span token
    budget: int  # tokens zoomed per (layer, KV head)
    steps: torch.Tensor  # (Tq,) answer-time step of each position: 0 question, i answer token i
    gates: list[torch.Tensor] = field(default_factory=list)  # per layer (Hkv, G, Tq, N)


def answer_steps(n: int, answer_len: int, device=None) -> torch.Tensor:
    """(n,) step of each of ``n`` question+answer positions (the last ``answer_len`` are the
    answer): 0 for the question, then 1, 2, … one per answer token."""
    q_len = n - answer_len
    return (torch.arange(n, device=device) - q_len + 1).clamp(min=0)


def step_decisions(
    z: torch.Tensor,
    steps: torch.Tensor,
    lengths: torch.Tensor,
    budget: int,
    neighbours: int = NEIGHBOURS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Answer-time zoom decisions from gate logits z (Hkv, G, Tq, N).

    Per step (``steps`` (Tq,) numbers each position's step, 0 = the question's prefill) and KV
    head: the best gate logit over the group's heads and the step's queries -> (Hkv, P, N), and
    the hard decision (gate > 0, best first under ``budget``; spans widened to their neighbours
    as answering widens them, :func:`~sekv_core.zoom.attention.widen`) -> (Hkv, P, N) bool. The
    straight-through gradient reaches each span's own gate.
    """
    best = step_best(z, steps)
    Hkv, P, N = best.shape
    hard, _ = select(widen(best.detach().reshape(Hkv * P, N), neighbours), lengths, budget, None)
    return best, hard.view(Hkv, P, N)


def student_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sekv_student=None, **_
):
    """Mixed attention with a straight-through hard zoom per (query head, query, span)."""
    ctx: StudentContext = sekv_student
    layer, memory = module.layer_idx, ctx.memory
    _, Hq, Tq, D = query.shape
    Hkv = key.shape[1]
    scaling = scaling if scaling is not None else D**-0.5
    q = query[0].view(Hkv, Hq // Hkv, Tq, D)
    with torch.no_grad():
        spans = sketch_spans(memory, layer, q.detach(), scaling)
    z = ctx.net.gate.logits(layer, q, spans, memory.log_len, scaling, ctx.steps)
    ctx.gates.append(z)
    # the answer-time decisions (one per step: question prefill, then each answer token), per
    # KV head, hard forward, straight-through gradients
    best, hard = step_decisions(z, ctx.steps, memory.lengths, ctx.budget)  # (Hkv, P, N)
    soft = torch.sigmoid(best)
    zoom = hard.to(soft.dtype) + soft - soft.detach()
    keep = zoom[:, ctx.steps.to(zoom.device)][:, None][..., ctx.span_id]  # (Hkv, 1, Tq, S)

    fixed_k, fixed_v = memory.fixed_kv(layer, q.dtype)
    lf = torch.einsum("hgtd,hfd->hgtf", q, fixed_k).float() * scaling
    ls = torch.einsum("hgtd,hsd->hgts", q, ctx.span_k[layer]).float() * scaling
    ll = torch.einsum("hgtd,hld->hgtl", q, key[0]).float() * scaling
    ll = ll.masked_fill(~causal_local(Tq, key.shape[2], q.device), float("-inf"))
    top = torch.cat([lf, ls, ll], dim=-1).amax(-1, keepdim=True).detach()
    ef, es, el = (lf - top).exp(), (ls - top).exp() * keep, (ll - top).exp()
    total = ef.sum(-1, keepdim=True) + es.sum(-1, keepdim=True) + el.sum(-1, keepdim=True)
    out = (
        torch.einsum("hgtf,hfd->hgtd", ef, fixed_v.float())
        + torch.einsum("hgts,hsd->hgtd", es, ctx.span_v[layer].float())
        + torch.einsum("hgtl,hld->hgtd", el, value[0].float())
    )
    out = out / total
    return out.to(query.dtype).reshape(Hq, Tq, D).transpose(0, 1)[None].contiguous(), None


def student_forward(
    loaded: LoadedModel, net: ZoomNet, doc: PreparedDoc, ex: Example, budget: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Student logits at the answer positions (Ta, V) and gate logits per layer
    (Hkv, G, Tq, N) each, zooming at most ``budget`` tokens per (layer, KV head) per decision."""
    model = loaded.model
    n = len(ex.ids)
    steps = answer_steps(n, ex.answer_len, loaded.device)
    ctx = StudentContext(
        doc.memory, net, doc.span_k, doc.span_v, doc.span_id.to(loaded.device), budget, steps
    )
    pos = torch.arange(n, device=loaded.device)[None] + doc.context_len
    with use_attention(model, STUDENT, student_attention):
        out = model(
            input_ids=torch.tensor([ex.ids], device=loaded.device),
            position_ids=pos,
            cache=DynamicCache(config=model.config),
            use_cache=True,
            logits_to_keep=ex.answer_len + 1,
            sekv_student=ctx,
        )
    return out.logits[0, :-1].float(), ctx.gates
