"""Teacher signals from the frozen full-KV model, and the student's differentiable zoom attention.

Teacher: the question + answer tokens run over the document's full KV cache; per layer and query
head, the attention mass each span receives at every one of those positions is summed span by span
as each layer is computed (one layer's (heads x queries x context) map at a time, never all
layers' maps), and the next-token log-probabilities at the answer positions are kept.

Student: the same tokens run with a local cache only; every layer attends, in one softmax, to the
sinks/anchors, the span tokens the gate zooms (exact full-resolution K/V) and the local tokens.
The zoom decision is the answer-time one (per KV head, gate > 0, best first under a token
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
from transformers import AttentionInterface

from ..attention import NEIGHBOURS, widen
from ..near import near_count, near_spans
from ..router import select
from ..zoom import SpanMemory
from ..zoomnet import ZoomNet, sketch_spans, step_best

TEACHER, STUDENT = "sekv_teacher", "sekv_student"


@dataclass
class TeacherTrace:
    """Filled by the teacher pass: span mass per layer, (Hq, Tq, N) each."""

    span_of_token: torch.Tensor  # (T,) span index of each context token, N for sinks/anchors
    n_spans: int
    mass: list[torch.Tensor] = field(default_factory=list)


def _causal_local(q_len: int, local_len: int, device) -> torch.Tensor:
    """(Tq, Tl) visibility of local keys for the last Tq of Tl local positions."""
    cols = torch.arange(local_len, device=device)[None]
    rows = torch.arange(local_len - q_len, local_len, device=device)[:, None]
    return cols <= rows


def teacher_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sekv_teacher=None, **_
):
    """Plain causal attention over [context | new tokens] that also sums span mass per head."""
    trace: TeacherTrace = sekv_teacher
    _, Hq, Tq, D = query.shape
    Hkv, Tl = key.shape[1], key.shape[2]
    T = Tl - Tq  # context tokens in the cache
    scaling = scaling if scaling is not None else D**-0.5
    k = key[0].repeat_interleave(Hq // Hkv, dim=0)  # (Hq, Tl, D)
    v = value[0].repeat_interleave(Hq // Hkv, dim=0)
    logits = torch.einsum("htd,hsd->hts", query[0], k).float() * scaling
    visible = torch.ones(Tq, Tl, dtype=torch.bool, device=query.device)
    visible[:, T:] = _causal_local(Tq, Tq, query.device)
    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    mass = probs.new_zeros(Hq, Tq, trace.n_spans + 1)
    mass.index_add_(2, trace.span_of_token, probs[..., :T])
    trace.mass.append(mass[..., :-1])
    out = torch.einsum("hts,hsd->htd", probs.to(v.dtype), v)
    return out.transpose(0, 1)[None].contiguous(), None


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
    near: float = 0.0  # near spans' share of the budget, as answering takes them (0: none)
    gates: list[torch.Tensor] = field(default_factory=list)  # per layer (Hkv, G, Tq, N)


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
    as answering widens them, :func:`~sekv_core.attention.widen`) -> (Hkv, P, N) bool. The
    straight-through gradient reaches each span's own gate.
    """
    best = step_best(z, steps)
    Hkv, P, N = best.shape
    hard, _ = select(widen(best.detach().reshape(Hkv * P, N), neighbours), lengths, budget, None)
    return best, hard.view(Hkv, P, N)


def answer_steps(n: int, answer_len: int, device=None) -> torch.Tensor:
    """(n,) step of each of ``n`` question+answer positions (the last ``answer_len`` are the
    answer): 0 for the question, then 1, 2, … one per answer token."""
    q_len = n - answer_len
    return (torch.arange(n, device=device) - q_len + 1).clamp(min=0)


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
    ll = ll.masked_fill(~_causal_local(Tq, key.shape[2], q.device), float("-inf"))
    top = torch.cat([lf, ls, ll], dim=-1).amax(-1, keepdim=True).detach()
    ef, es, el = (lf - top).exp(), (ls - top).exp() * keep, (ll - top).exp()
    total = ef.sum(-1, keepdim=True) + es.sum(-1, keepdim=True) + el.sum(-1, keepdim=True)
    out = (
        torch.einsum("hgtf,hfd->hgtd", ef, fixed_v.float())
        + torch.einsum("hgts,hsd->hgtd", es, ctx.span_v[layer].float())
        + torch.einsum("hgtl,hld->hgtd", el, value[0].float())
    )
    near = near_weights(ctx, best, hard, spans.log_mass, top)  # (Hkv, G, Tq, N) or None
    if near is not None:
        out = out + torch.einsum("hgtn,hnd->hgtd", near, memory.summary_v[layer].float())
        total = total + near.sum(-1, keepdim=True)
    out = out / total
    return out.to(query.dtype).reshape(Hq, Tq, D).transpose(0, 1)[None].contiguous(), None


def near_weights(
    ctx: StudentContext,
    best: torch.Tensor,
    hard: torch.Tensor,
    log_mass: torch.Tensor,
    top: torch.Tensor,
) -> torch.Tensor | None:
    """The near spans' unnormalised softmax weights (Hkv, G, Tq, N) (relative to ``top``), as
    answering takes them (:mod:`sekv_core.near`): per decision, the best-ranked spans by the
    widened gate logits ``best`` (Hkv, P, N) that ``hard`` left out, each weighing its tokens'
    sketch-estimated mass ``log_mass`` (Hkv, G, Tq, N); None without near spans. The choice is
    hard and carries no gradient (the zoom decision's straight-through estimate does)."""
    memory = ctx.memory
    count = near_count(ctx.near, ctx.budget, memory.mean_span_length)
    if count == 0:
        return None
    Hkv, P, N = best.shape
    with torch.no_grad():
        ranked = widen(best.reshape(Hkv * P, N), NEIGHBOURS)
        index, valid = near_spans(ranked, hard.reshape(Hkv * P, N), count)
        held = torch.zeros(Hkv * P, N, device=best.device).scatter(1, index, valid.float())
        held = held.view(Hkv, P, N)[:, ctx.steps.to(best.device)][:, None]  # (Hkv, 1, Tq, N)
    return (log_mass.float() - top).exp() * held


AttentionInterface.register(TEACHER, teacher_attention)
AttentionInterface.register(STUDENT, student_attention)
