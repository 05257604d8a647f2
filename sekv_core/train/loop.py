"""`sekv train`: learn the zoom gate and rank gate with the base model frozen.

Per training example (a generated document, one question about a planted fact, and the answer
to distil along: by default the full-KV model's own greedy answer, as `sekv bench fidelity` reads):

- the document's span store is built (or loaded) exactly as for answering, and its full KV cache
  is computed once (teacher);
- teacher pass: question + answer over the full cache -> next-token log-probs at the answer
  positions and per-(layer, head, position) span attention mass; positions whose span mass is
  >= ``MINE_MASS`` are *mined*; their targets are the fewest spans holding ``rho`` of it;
- student pass (differentiable): the same tokens with the gated mixed attention.

Loss = KL(teacher || student) on the answer tokens + ``w_order`` * listwise ranking loss of each
answer-time decision against the teacher's span mass + ``w_zoom`` * zoom BCE on mined positions
(positives up-weighted) + ``w_budget`` * expected share of context tokens zoomed + ``w_rank`` *
(reconstruction error of the gated spectrum + ``rank_cost`` * kept rank share).
"""

from __future__ import annotations

import copy
import math
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..attention import NEIGHBOURS, attention_switch
from ..documents import load_document
from ..errors import SekvError
from ..methods.full import answer_over, prefill_cache, truncate
from ..methods.sekv import MIN_ZOOM
from ..models import LoadedModel
from ..prompt import chat_template, encode_context, encode_question
from ..rope import Rope
from ..store import StoreSettings, open_or_build, padded_blocks
from ..zoom import SpanMemory
from ..zoomnet import NetShape, ZoomNet, load_router, save_router, step_best
from .data import make_corpus
from .signals import (
    STUDENT,
    TEACHER,
    StudentContext,
    TeacherTrace,
    answer_steps,
    step_decisions,
)

MINE_MASS = 0.05  # a position "reaches far back" when >= this share of its attention is on spans


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 300
    docs: int = 8
    held_out: int = 2
    seed: int = 0
    lr: float = 5e-3
    rho: float = 0.9
    w_order: float = 1.0
    w_zoom: float = 1.0
    w_budget: float = 0.5
    w_rank: float = 1.0
    rank_cost: float = 0.1
    dim: int = 3
    doc_tokens: tuple[int, int] = (500, 1500)
    # zoom budgets drawn per step (share of span tokens); memory targets of 10-20% of full KV
    # leave ~4-18% of the span tokens to zoom once the resident tier is paid (8-bit zoom)
    budget_shares: tuple[float, float] = (0.02, 0.2)
    eval_shares: tuple[float, ...] = (0.05, 0.1, 0.15)
    # below this share, answers route with the sketch's strongest half when the whole one would
    # starve the zoom (methods.sekv.STARVED_SHARE): steps under it draw either, half the time
    half_sketch_below: float = 0.12
    # answers to distil along: the teacher's own greedy answer up to this many tokens (what
    # `sekv bench fidelity` compares along), 0: the planted fact's answer string
    answer_tokens: int = 24
    # near spans (sekv_core.near) in the student's softmax, this share of the zoom budget, as
    # answering with ``--near`` takes them (0: none); a router trained with them answers with them
    near: float = 0.0
    save_every: int = 50
    eval_every: int = 100  # held-out evaluation; the router file keeps the best one (step 0 too)


@dataclass
class Example:
    """One question on one prepared document (teacher targets included)."""

    doc: int
    ids: list[int]  # question + answer tokens
    answer_len: int
    teacher_logp: torch.Tensor  # (Ta, V) log-probs of the answer positions
    mass: torch.Tensor  # (L, Hq, Tq, N) teacher span mass


@dataclass
class PreparedDoc:
    memory: SpanMemory
    context_len: int
    span_k: list[torch.Tensor]
    span_v: list[torch.Tensor]
    span_id: torch.Tensor
    spectra: tuple[torch.Tensor, ...]  # kind, layer, head (B,) and sigma (B, D)


Log = Callable[[str], None]


def prepare(
    loaded: LoadedModel, settings: TrainSettings, log: Log, store: StoreSettings | None = None
) -> tuple[list, list, list]:
    """Generate the corpus; build stores (``store``: answering's default settings) and teacher
    signals. Returns docs, train, held-out."""
    tok = loaded.tokenizer
    template = chat_template(tok)
    corpus = make_corpus(tok, settings.docs + settings.held_out, settings.seed, settings.doc_tokens)
    docs: list[PreparedDoc] = []
    examples: list[Example] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, train_doc in enumerate(corpus):
            t0 = time.perf_counter()
            path = Path(tmp) / f"train-{settings.seed}-{i}.txt"
            path.write_text(train_doc.text)
            document = load_document(path)
            context = encode_context(tok, template, document.text)
            span_store, _ = open_or_build(loaded, document, context, store or StoreSettings())
            memory = SpanMemory(span_store, Rope(loaded.model), loaded.device, loaded.dtype)
            cache = prefill_cache(loaded.model, context.ids, 512)
            doc = _prepared(memory, cache, len(context))
            docs.append(doc)
            for fact in train_doc.facts:
                q = encode_question(tok, template, fact.question)
                a = tok(" " + fact.answer, add_special_tokens=False)["input_ids"]
                if settings.answer_tokens:
                    a = teacher_answer(loaded, cache, len(context), q, settings.answer_tokens) or a
                examples.append(_teacher(loaded, cache, doc, i, q + a, len(a)))
            del cache
            log(
                f"prepared document {i + 1}/{len(corpus)} ({len(context)} tokens, "
                f"{memory.n_spans} spans) in {time.perf_counter() - t0:.1f} s"
            )
    held = [e for e in examples if e.doc >= settings.docs]
    return docs, [e for e in examples if e.doc < settings.docs], held


def teacher_answer(
    loaded: LoadedModel, cache: DynamicCache, context_len: int, question: list[int], limit: int
) -> list[int]:
    """The full-KV model's own greedy answer to ``question`` (up to ``limit`` tokens); the
    cache is left holding the document alone."""
    try:
        return list(answer_over(loaded, cache, question, limit))
    finally:
        truncate(cache, context_len)


def _prepared(memory: SpanMemory, cache: DynamicCache, context_len: int) -> PreparedDoc:
    starts, ends = memory.starts, memory.ends
    tokens = torch.cat([torch.arange(int(s), int(e)) for s, e in zip(starts, ends, strict=True)])
    span_k = [layer.keys[0][:, tokens].detach().clone() for layer in cache.layers]
    span_v = [layer.values[0][:, tokens].detach().clone() for layer in cache.layers]
    return PreparedDoc(
        memory, context_len, span_k, span_v, memory.sketch_span.cpu(), spectra(memory)
    )


def spectra(memory: SpanMemory) -> tuple[torch.Tensor, ...]:
    """Kind (0: keys, 1: values), layer, head (B,) and stored spectrum sigma (B, D), 0-padded, of
    every factorised (layer, head, span) of a store, in that order: the rank gate's inputs.
    Read in one batch per kind (the column norms of the stored U diag(sigma))."""
    t, D = memory.tables, memory.head_dim
    lengths = memory.ends - memory.starts
    parts = []
    for ki, kind in enumerate(("k", "v")):
        layer, head, span = torch.nonzero(~t[f"{kind}_raw"].bool(), as_tuple=True)
        if not span.numel():
            continue
        n, r = lengths[span], t[f"{kind}_rank"][layer, head, span].long()
        c0 = t[f"{kind}_coef_off"][layer, head, span].long()
        flat = memory.store.offload_ranges(f"{kind}_coef", c0, c0 + n * r)
        coef = padded_blocks(flat, n, r, (span.numel(), int(n.max()), D))
        parts.append((torch.full_like(span, ki), layer, head, coef.float().norm(dim=1)))
    if not parts:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty, empty, torch.zeros(0, D)
    return tuple(torch.cat(column) for column in zip(*parts, strict=True))


@torch.inference_mode()
def _teacher(
    loaded: LoadedModel, cache: DynamicCache, doc: PreparedDoc, index: int, ids, answer_len
) -> Example:
    model, memory = loaded.model, doc.memory
    span_of = torch.full((doc.context_len,), memory.n_spans, dtype=torch.long)
    span_of[_span_tokens(memory)] = memory.sketch_span.cpu()
    trace = TeacherTrace(span_of.to(loaded.device), memory.n_spans)
    try:
        with attention_switch(model, TEACHER):
            out = model(
                input_ids=torch.tensor([ids], device=loaded.device),
                cache=cache,
                use_cache=True,
                logits_to_keep=answer_len + 1,
                sekv_teacher=trace,
            )
    finally:
        truncate(cache, doc.context_len)
    logp = out.logits[0, :-1].float().log_softmax(-1).cpu()
    return Example(index, list(ids), answer_len, logp, torch.stack(trace.mass).cpu())


def _span_tokens(memory: SpanMemory) -> torch.Tensor:
    return torch.cat(
        [torch.arange(int(s), int(e)) for s, e in zip(memory.starts, memory.ends, strict=True)]
    )


def zoom_targets(mass: torch.Tensor, rho: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mined positions and their targets from teacher span mass (..., N).

    Returns mined (...,) bool — positions putting >= MINE_MASS of attention on spans — and
    targets (..., N) bool: the fewest spans holding ``rho`` of each position's span mass.
    """
    total = mass.sum(-1)
    order = mass.argsort(-1, descending=True)
    sorted_mass = mass.gather(-1, order)
    before = sorted_mass.cumsum(-1) - sorted_mass  # mass of the better spans
    take = before < rho * total[..., None]
    targets = torch.zeros_like(take).scatter(-1, order, take)
    return total >= MINE_MASS, targets


def student_forward(
    loaded: LoadedModel,
    net: ZoomNet,
    doc: PreparedDoc,
    ex: Example,
    budget: int,
    near: float = 0.0,
):
    """Student logits at the answer positions (Ta, V) and gate logits per layer (``near``:
    the near spans' share of the budget)."""
    model = loaded.model
    n = len(ex.ids)
    steps = answer_steps(n, ex.answer_len, loaded.device)
    ctx = StudentContext(
        doc.memory, net, doc.span_k, doc.span_v, doc.span_id.to(loaded.device), budget, steps, near
    )
    pos = torch.arange(n, device=loaded.device)[None] + doc.context_len
    with attention_switch(model, STUDENT):
        out = model(
            input_ids=torch.tensor([ex.ids], device=loaded.device),
            position_ids=pos,
            cache=DynamicCache(config=model.config),
            use_cache=True,
            logits_to_keep=ex.answer_len + 1,
            sekv_student=ctx,
        )
    return out.logits[0, :-1].float(), ctx.gates


def kl_to_teacher(logits: torch.Tensor, ex: Example) -> torch.Tensor:
    """KL(teacher || student) over the answer positions (batch mean)."""
    return F.kl_div(
        logits.log_softmax(-1),
        ex.teacher_logp.to(logits.device),
        log_target=True,
        reduction="batchmean",
    )


def budget_tokens(doc: PreparedDoc, share: float) -> int:
    """A zoom budget of ``share`` of the document's span tokens (at least the ``MIN_ZOOM``
    tokens answering zooms under any memory target; spans that do not fit are skipped)."""
    return max(MIN_ZOOM, int(share * int(doc.memory.lengths.sum())))


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
    logits, gates = student_forward(loaded, net, doc, ex, budget_tokens(doc, share), s.near)
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
    recon, rank = rank_losses(net, doc)
    total = (
        kl
        + s.w_order * order
        + s.w_zoom * bce
        + s.w_budget * budget
        + s.w_rank * (recon + s.rank_cost * rank)
    )
    return {
        "loss": total,
        "kl": kl,
        "order": order,
        "zoom_bce": bce,
        "budget": budget,
        "recon": recon,
        "rank": rank,
    }


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


def rank_losses(net: ZoomNet, doc: PreparedDoc, sample: int = 512) -> tuple[torch.Tensor, ...]:
    """Reconstruction error of the gated spectrum and the kept rank share, on sampled spans."""
    kinds, layers, heads, sigma = doc.spectra
    if len(sigma) == 0:
        zero = net.rank.bias.sum() * 0
        return zero, zero
    pick = torch.randint(len(sigma), (min(sample, len(sigma)),))
    s = sigma[pick]
    g = net.rank.gates(0, layers[pick], heads[pick], s)
    g_v = net.rank.gates(1, layers[pick], heads[pick], s)
    g = torch.where((kinds[pick] == 0)[:, None], g, g_v)
    stored = s > 0
    energy = s.square()
    recon = (((1 - g) ** 2 * energy).sum(-1) / energy.sum(-1).clamp(min=1e-12)).mean()
    rank = ((g * stored).sum(-1) / s.shape[-1]).mean()
    return recon, rank


@torch.no_grad()
def evaluate(loaded: LoadedModel, net: ZoomNet, docs, held: list[Example], s: TrainSettings):
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
            logits, gates = student_forward(loaded, net, doc, ex, budget, s.near)
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


def train(
    loaded: LoadedModel,
    out: Path,
    settings: TrainSettings,
    log: Log = print,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Train (or resume) the zoom router for ``loaded``; write it to ``out``. Returns metrics."""
    torch.manual_seed(settings.seed)
    spec = loaded.spec
    config = loaded.model.config
    shape = NetShape(
        spec.num_layers,
        config.num_attention_heads,
        spec.num_kv_heads,
        spec.head_dim,
        settings.dim,
    )
    net = ZoomNet(shape).to(loaded.device)
    opt = torch.optim.Adam(net.parameters(), lr=settings.lr)
    start, resumed = _resume(out, net, opt, loaded, settings, log)
    if start >= settings.steps:
        log(f"{out} already holds {start} steps (>= --steps {settings.steps}); nothing to do")
        manifest = load_router(out).manifest
        return {
            "parameters": net.num_parameters(),
            **manifest.get("metrics", {}),
            "training_free": manifest.get("training_free_metrics", {}),
        }
    loaded.model.requires_grad_(False)
    docs, examples, held = prepare(loaded, settings, log)
    if not examples:
        raise SekvError("no training examples were generated; raise --docs")
    untrained = ZoomNet(shape).to(loaded.device)
    base = evaluate(loaded, untrained, docs, held, settings)
    log(f"training-free start (held out): {base}")
    # model selection on the held-out documents: the training-free start is a candidate too,
    # and so are the weights a finished run kept (they are what a resumed run starts from)
    best = (held_out_score(base), 0, untrained.state_dict(), base)
    if resumed.get("metrics") and held_out_score(resumed["metrics"]) < best[0]:
        kept = copy.deepcopy(net.state_dict())
        best = (
            held_out_score(resumed["metrics"]),
            resumed["selected_step"],
            kept,
            resumed["metrics"],
        )
    order = random.Random(settings.seed)
    schedule = [
        i
        for _ in range(math.ceil(settings.steps / len(examples)))
        for i in order.sample(range(len(examples)), len(examples))
    ]
    running: dict[str, float] = {}
    t0 = time.perf_counter()
    for step in range(start, settings.steps):
        ex = examples[schedule[step]]
        parts = losses(loaded, net, docs[ex.doc], ex, settings)
        opt.zero_grad(set_to_none=True)
        parts["loss"].backward()
        opt.step()
        for k, v in parts.items():
            value = float(v.detach())
            running[k] = 0.9 * running.get(k, value) + 0.1 * value
        if progress:
            progress(step + 1, settings.steps)
        if (step + 1) % 10 == 0 or step + 1 == settings.steps:
            log(
                f"step {step + 1}/{settings.steps} "
                + " ".join(f"{k} {v:.4f}" for k, v in running.items())
                + f" ({time.perf_counter() - t0:.0f} s)"
            )
        if (step + 1) % settings.save_every == 0 and step + 1 < settings.steps:
            _save(out, net, opt, loaded, settings, step + 1, running, {}, base)
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            metrics = evaluate(loaded, net, docs, held, settings)
            log(f"step {step + 1} (held out): {metrics}")
            if held_out_score(metrics) < best[0]:
                best = (held_out_score(metrics), step + 1, copy.deepcopy(net.state_dict()), metrics)
    _, chosen, weights, metrics = best
    log(f"kept the weights of step {chosen} (lowest held-out KL to the teacher; 0 = untrained)")
    net.load_state_dict(weights)
    _save(
        out, net, opt, loaded, settings, max(start, settings.steps), running, metrics, base, chosen
    )
    return {
        "parameters": net.num_parameters(),
        "selected_step": chosen,
        **metrics,
        "training_free": base,
    }


def held_out_score(metrics: dict[str, float]) -> float:
    """Model selection: the mean KL to the teacher over the evaluated budget shares."""
    kls = [v for k, v in metrics.items() if k.startswith("kl@")]
    return sum(kls) / max(len(kls), 1)


def _manifest(loaded, settings, step, running, metrics, base, net, chosen) -> dict[str, Any]:
    base_params = sum(p.numel() for p in loaded.model.parameters())
    return {
        "model": {"id": loaded.model_id, "fingerprint": loaded.fingerprint},
        "settings": {
            k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()
        },
        "step": step,
        "selected_step": step if chosen is None else chosen,
        "parameters": net.num_parameters(),
        "parameter_share": net.num_parameters() / base_params,
        "losses": {k: round(v, 5) for k, v in running.items()},
        "metrics": metrics,
        "training_free_metrics": base,
        "routing": trained_routing(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def trained_routing() -> dict[str, Any]:
    """What training routed over (answering's defaults): span lengths and neighbours."""
    segment = StoreSettings().segment
    return {"span_tokens": [segment.min_len, segment.max_len], "neighbours": NEIGHBOURS}


def _save(out, net, opt, loaded, settings, step, running, metrics, base, chosen=None) -> None:
    names = {id(p): n for n, p in net.named_parameters()}
    optim = {}
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    optim[f"{names[id(p)]}/{key}"] = state[key].detach().cpu().contiguous()
            if "step" in state:
                optim[f"{names[id(p)]}/step"] = torch.as_tensor(state["step"]).reshape(1).float()
    manifest = _manifest(loaded, settings, step, running, metrics, base, net, chosen)
    save_router(out, net, manifest, optim)


def _resume(
    out: Path, net: ZoomNet, opt, loaded, settings: TrainSettings, log: Log
) -> tuple[int, dict[str, Any]]:
    """Continue from ``out`` when it holds a compatible run (weights + optimizer state).

    Returns the step reached and the run's manifest ({} for a new run); a finished run's file
    holds the weights it kept, with their held-out metrics."""
    state_file = out.with_name(out.name + ".state")
    if not out.exists():
        return 0, {}
    router = load_router(out, loaded.fingerprint, loaded.model_id)
    if router.manifest["shape"]["dim"] != settings.dim:
        raise SekvError(
            f"{out} was trained with --dim {router.manifest['shape']['dim']}; "
            "use another --out or the same settings"
        )
    net.load_state_dict(router.net.state_dict())
    net.requires_grad_(True)
    if state_file.exists():
        from safetensors.torch import load_file

        saved = load_file(str(state_file))
        for name, p in net.named_parameters():
            if f"{name}/exp_avg" in saved:
                opt.state[p] = {
                    "step": saved[f"{name}/step"][0].clone(),
                    "exp_avg": saved[f"{name}/exp_avg"].to(p.device),
                    "exp_avg_sq": saved[f"{name}/exp_avg_sq"].to(p.device),
                }
    step = int(router.manifest.get("step", 0))
    log(f"resuming from {out} at step {step}")
    return step, router.manifest
