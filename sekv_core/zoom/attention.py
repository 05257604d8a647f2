"""Mixed-resolution attention, plugged into transformers through its AttentionInterface.

For the question tokens and every generated token, each layer attends in ONE softmax over:

    [ sinks + anchors | zoomed spans' tokens | local ]

where *local* is the question + generated tokens (full resolution, in an ordinary cache). Each
KV head zooms its own spans: their reconstructed tokens join that head's softmax. Batched over
heads and spans.

:func:`sekv_attention` registers the implementation (under the name ``"sekv"``) and switches a
model to it for the duration of a block. Within the model window, keys are stored post-RoPE at
their original positions and local tokens take positions after the context, so nothing is
re-rotated; a book's memory is *bounded* (see :mod:`sekv_core.zoom.memory` for its positions).

Several memories within the window can be read together (:class:`MemoryGroup`): each routes
and zooms by its own policy, and their entries join the same softmax, the local tokens after
the last context's end (:func:`group_attention`).

The streamed ingest (:mod:`sekv_core.store.stream`) runs the same function for each chunk of a book,
with a :class:`LocalWindow`: the previous tokens at full resolution join the local part, and the
chunk's own K/V are captured for the store.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from ..backend import use_attention
from ..config import DEFAULT_BUDGET, MethodSettings
from ..rope import rotate_half
from ..sketch import QueryMoments
from .memory import SpanMemory
from .prefilter import PREFILTER_KEEP, PREFILTER_SPANS, candidates
from .router import Router, select
from .trace import ZoomTrace

NAME = "sekv"
NEIGHBOURS = MethodSettings.neighbours  # see ZoomPolicy.neighbours and :func:`widen`
ABSENT = torch.finfo(torch.float32).min  # the bias of an entry left out (as a pool's free slot)

Observer = Callable[["ZoomPolicy", SpanMemory, int, torch.Tensor, float, torch.Tensor], None]
"""observer(policy, memory, layer, q, scaling, zoom): told of every routing decision (the
benchmarks' diagnostics measure routing against an oracle through it)."""


@dataclass
class ZoomPolicy:
    """How one answer routes: router, token budget per (layer, KV head), threshold margin;
    and, over a bounded memory, where its zoomed tokens sit (``pool_end``, ``placement``)."""

    router: Router
    budget: int = DEFAULT_BUDGET
    margin: float | None = MethodSettings.margin  # None: the router's scores are gate logits
    trace: ZoomTrace = field(default_factory=ZoomTrace)
    route_queries: int | None = None  # route with this many of the queries (evenly spaced)
    track_mass: bool = True  # record the attention share of zoomed spans (off: a fused kernel)
    attribute: bool = True  # with track_mass: what the answer drew on (sekv_core.sources)
    prefilter_spans: int = PREFILTER_SPANS  # above this many spans, the router scores ...
    prefilter_keep: int = PREFILTER_KEEP  # ... at least this many per KV head (the best by
    # their representative tokens): see sekv_core.zoom.prefilter.candidates
    prefilter_blocks: bool = False  # find them through the coarse block index (flat cost)
    neighbours: int = NEIGHBOURS  # a span scores the best of itself and this many on each side
    # attend to the zoomed tokens in document order, whatever the pools held before (a streamed
    # build: resumed or not, the same store)
    ordered: bool = False
    observer: Observer | None = None  # told of every decision (diagnostics)
    # books: the passages every layer and KV head reads (N,) bool, and the question's scores
    # that chose them (N,): no routing per step (sekv_core.passages)
    pinned: torch.Tensor | None = None
    pinned_scores: torch.Tensor | None = None
    pinned_recorded: set[int] = field(default_factory=set)  # layers whose trace has them
    # bounded memories: the first local position (the zoomed tokens end right before it)
    pool_end: int | None = None
    # bounded: (N,) where each span's passage goes among the answer's passages (larger: nearer
    # the question; sekv_core.passages.placement); None: document order
    placement: torch.Tensor | None = None


@dataclass
class LocalWindow:
    """Streamed ingest: full-resolution tokens before the current chunk, and the chunk's capture.

    keys, values : (L, H_kv, W, D) the previous tokens (keys pre-RoPE); cos, sin : (W, D) RoPE
    tables of their positions. After the forward, ``captured`` holds per layer the chunk's
    (post-RoPE keys, values), each (H_kv, Tq, D). ``moments``, when given, sums the chunk's
    queries' second moments (the routing sketch's weighting).
    """

    keys: torch.Tensor
    values: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    captured: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    moments: QueryMoments | None = None

    def extend(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The local K/V of ``layer``: window (rotated to its positions) + the chunk's own."""
        self.captured.append((key, value))
        k = self.keys[layer].to(key.dtype)
        k = k * self.cos + rotate_half(k) * self.sin  # (H, W, D)
        return torch.cat([k, key], dim=1), torch.cat([self.values[layer].to(value.dtype), value], 1)


@dataclass(frozen=True)
class GroupMember:
    """One memory of a :class:`MemoryGroup`, routed by its own ``policy`` (its zoom budget,
    pools and trace).

    Its context begins with the chat template's ``head`` (tokens at positions below it), the
    same in every context: a member that does not ``read_head`` leaves its copy out of the
    softmax (another member holds it). ``shift`` moves the document's tokens after the head
    that many positions on: its keys are rotated on at use, and it routes with the queries
    rotated back, as if the question came right after its own context.
    """

    memory: SpanMemory
    policy: ZoomPolicy
    head: int = 0
    read_head: bool = True
    shift: int = 0


@dataclass(frozen=True)
class MemoryGroup:
    """Several memories read in ONE softmax ("parallel context windows").

    Each memory keeps its keys at its own positions (contexts within the window: none
    ``bounded``; a member may be shifted on), and the local tokens take positions after the
    last context's end (:attr:`local_start`), so every RoPE distance stays inside the window.
    """

    members: tuple[GroupMember, ...]

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError("a memory group needs at least one memory")
        if any(m.memory.bounded for m in self.members):
            raise ValueError("bounded memories (beyond the window) cannot be read together")
        if any(m.shift < 0 for m in self.members):
            raise ValueError("a memory is shifted on, never back")

    @property
    def local_start(self) -> int:
        """The local tokens' first position: after every (shifted) context."""
        return max(m.memory.context_len + m.shift for m in self.members)


def mixed_attention(
    q: torch.Tensor,
    k_local: torch.Tensor,
    v_local: torch.Tensor,
    k_mem: torch.Tensor,
    v_mem: torch.Tensor,
    bias_mem: torch.Tensor,
    scaling: float,
    with_mass: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One softmax over memory entries and the causal local window.

    q : (Hkv, G, Tq, D); k_local, v_local : (Hkv, Tl, D), the last Tq of which are the queries';
    k_mem, v_mem : (Hkv, M, D); bias_mem : (Hkv, M) additive logit bias (-inf = absent).
    Returns the output (Hkv, G, Tq, D) and the attention mass of each memory entry per query,
    summed over the group's heads (Hkv, Tq, M) — or None without ``with_mass``: then the fused
    ``scaled_dot_product_attention`` runs (a streamed chunk: many queries, long window).
    """
    Tq, Tl = q.shape[2], k_local.shape[1]
    if not with_mass:
        H = q.shape[0]
        visible = (
            torch.arange(Tl, device=q.device)[None]
            <= torch.arange(Tl - Tq, Tl, device=q.device)[:, None]
        )  # (Tq, Tl)
        present = bias_mem > torch.finfo(torch.float32).min / 2  # (Hkv, M)
        if bool((bias_mem[present] == 0).all()):  # entries are in or out: a boolean mask
            mask = torch.cat(
                [present[:, None].expand(-1, Tq, -1), visible.expand(H, -1, -1)], dim=-1
            )  # (Hkv, Tq, M + Tl)
        else:
            local = torch.zeros(Tq, Tl, device=q.device).masked_fill(~visible, float("-inf"))
            mask = torch.cat(
                [bias_mem.float()[:, None].expand(-1, Tq, -1), local.expand(H, -1, -1)], dim=-1
            ).to(q.dtype)
        out = torch.nn.functional.scaled_dot_product_attention(
            q,
            torch.cat([k_mem, k_local], dim=1)[:, None],
            torch.cat([v_mem, v_local], dim=1)[:, None],
            attn_mask=mask[:, None],
            scale=scaling,
            enable_gqa=True,
        )
        return out, None
    # one product over every entry, in float32 (no copy when the model's is), the bias (0 or
    # absent on memory, 0 on local) added in it
    H, G, _, D = q.shape
    M = k_mem.shape[1]
    bias = torch.cat([bias_mem.float(), bias_mem.new_zeros(H, Tl, dtype=torch.float32)], dim=1)
    logits = torch.baddbmm(
        bias[:, None],
        q.reshape(H, G * Tq, D).float(),
        torch.cat([k_mem, k_local], dim=1).float().transpose(1, 2),
        alpha=scaling,
    ).view(H, G, Tq, M + Tl)
    if Tq > 1:  # one query (a decoding step) sees the whole local window
        hidden = (
            torch.arange(Tl, device=q.device)[None]
            > torch.arange(Tl - Tq, Tl, device=q.device)[:, None]
        )  # (Tq, Tl)
        logits[..., M:].masked_fill_(hidden, float("-inf"))
    probs = logits.softmax(dim=-1).to(q.dtype)
    values = torch.cat([v_mem, v_local], dim=1)
    out = torch.bmm(probs.view(H, G * Tq, M + Tl), values).view(H, G, Tq, D)
    return out, probs[..., :M].float().sum(dim=1)


def sekv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sekv_memory: SpanMemory | None = None,
    sekv_policy: ZoomPolicy | None = None,
    sekv_window: LocalWindow | None = None,
    sekv_group: MemoryGroup | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query (1, Hq, Tq, D), key/value (1, Hkv, Tl, D) local.

    Reads one memory (``sekv_memory`` routed by ``sekv_policy``) or several at once
    (``sekv_group``: :func:`group_attention`). Without a memory (the first chunk of a streamed
    ingest), attention runs over the window and the local tokens only.
    """
    if sekv_group is None and (sekv_memory is None or sekv_policy is None) and sekv_window is None:
        raise RuntimeError("sekv attention called without sekv_memory / sekv_policy")
    layer = module.layer_idx
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    _, Hq, Tq, D = query.shape
    Hkv = key.shape[1]
    q = query[0].view(Hkv, Hq // Hkv, Tq, D)  # (Hkv, G, Tq, D)
    k_loc, v_loc = key[0], value[0]
    if sekv_window is not None:
        k_loc, v_loc = sekv_window.extend(layer, k_loc, v_loc)
        if sekv_window.moments is not None:
            sekv_window.moments.add(layer, query[0], Hkv)
    if sekv_group is not None:
        out = group_attention(sekv_group, layer, q, k_loc, v_loc, scaling)
        return out.reshape(Hq, Tq, D).transpose(0, 1)[None].contiguous(), None
    if sekv_memory is None or sekv_policy is None:
        empty = q.new_zeros(Hkv, 0, D)
        bias = q.new_zeros(Hkv, 0)
        out, _ = mixed_attention(q, k_loc, v_loc, empty, empty, bias, scaling, with_mass=False)
        return out.reshape(Hq, Tq, D).transpose(0, 1)[None].contiguous(), None
    memory, policy = sekv_memory, sekv_policy
    read = read_memory(memory, policy, layer, q, scaling)
    # a streamed chunk (no mass tracked) runs the fused kernel
    out, mass = mixed_attention(
        q, k_loc, v_loc, read.keys, read.values, read.bias, scaling, with_mass=policy.track_mass
    )
    if mass is not None:
        trace_attention(memory, policy, layer, read, mass, Hq)
    return out.reshape(Hq, Tq, D).transpose(0, 1)[None].contiguous(), None


@dataclass(frozen=True)
class MemoryRead:
    """What one attention call reads from one memory: K, V (Hkv, F + C, D) its sinks and
    anchors then its pool's C slots, the additive bias (Hkv, F + C) float32 (absent slots: the
    float32 minimum), and each slot's span ``owner`` and span token ``slots`` (Hkv, C), -1
    free."""

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor
    owner: torch.Tensor
    slots: torch.Tensor


def read_memory(
    memory: SpanMemory, policy: ZoomPolicy, layer: int, q: torch.Tensor, scaling: float
) -> MemoryRead:
    """Route queries ``q`` (Hkv, G, Tq, D) over ``memory``'s spans, bring the layer's pool to
    the picks, and hand out the memory's entries for the call."""
    zoom = route(memory, policy, layer, q, scaling)  # (Hkv, N) bool
    pool = memory.zoom_pool(layer, zoom, policy.budget, policy.pool_end, policy.placement)
    if policy.ordered:
        pool_k, pool_v, pool_bias, owner, slots = pool.in_document_order(q.dtype, policy.placement)
        k_mem, v_mem, bias = memory.entries(layer, pool_k, pool_v, pool_bias)
    else:  # (Hkv, C, D) every slot in the model dtype; inactive ones absent
        k_mem, v_mem, bias = memory.pool_entries(layer, pool, q.dtype)
        owner, slots = pool.owner, pool.token
    return MemoryRead(k_mem, v_mem, bias, owner, slots)


def trace_attention(
    memory: SpanMemory,
    policy: ZoomPolicy,
    layer: int,
    read: MemoryRead,
    mass: torch.Tensor,
    q_heads: int,
) -> None:
    """Record in the policy's trace the attention ``mass`` (Hkv, Tq, F + C) the queries paid
    the entries of ``read``: each zoomed span's share and (``policy.attribute``) what the
    answer drew on."""
    owner, slots = read.owner, read.slots
    if not policy.ordered:  # a decoding step: one native call on the CPU
        if policy.trace.add_step(layer, memory, mass, owner, slots, q_heads, policy.attribute):
            return
    Tq, P = mass.shape[1], owner.shape[1]
    pool_mass = mass[:, :, -P:].sum(dim=1) / (q_heads * Tq)  # (Hkv, P)
    policy.trace.add_mass(owner, pool_mass, memory.n_spans)
    if policy.attribute:
        # the last query predicts the next answer token: what the answer drew on
        positions = torch.cat([memory.fixed_positions[layer], memory.token_positions(slots)], 1)
        policy.trace.add_answer(
            layer, memory.num_layers, positions, mass[:, -1] / q_heads, memory.context_len
        )


def group_attention(
    group: MemoryGroup,
    layer: int,
    q: torch.Tensor,
    k_local: torch.Tensor,
    v_local: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Queries ``q`` (Hkv, G, Tq, D) over every memory of ``group`` and the local window
    ``k_local``, ``v_local`` (Hkv, Tl, D) in ONE softmax: each memory routes and zooms by its
    own policy, their entries are concatenated into one :func:`mixed_attention` call, and the
    attention is split back so that each policy's trace records its own memory's share.
    Returns the output (Hkv, G, Tq, D)."""
    reads = [read_member(m, layer, q, scaling) for m in group.members]
    with_mass = any(m.policy.track_mass for m in group.members)
    out, mass = mixed_attention(
        q,
        k_local,
        v_local,
        torch.cat([r.keys for r in reads], dim=1),
        torch.cat([r.values for r in reads], dim=1),
        torch.cat([r.bias for r in reads], dim=1),
        scaling,
        with_mass=with_mass,
    )
    if mass is not None:  # (Hkv, Tq, sum of E): each memory's entries in turn
        parts = mass.split([r.keys.shape[1] for r in reads], dim=2)
        Hq = q.shape[0] * q.shape[1]
        for member, read, part in zip(group.members, reads, parts, strict=True):
            if member.policy.track_mass:
                trace_attention(member.memory, member.policy, layer, read, part.contiguous(), Hq)
    return out


def read_member(member: GroupMember, layer: int, q: torch.Tensor, scaling: float) -> MemoryRead:
    """:func:`read_memory` of a group's member: keys after its head shifted on by
    ``member.shift`` (its routing sees the queries shifted back), its head's entries absent
    unless it ``read_head``."""
    memory, shift = member.memory, member.shift
    if shift == 0 and member.read_head:
        return read_memory(memory, member.policy, layer, q, scaling)
    routed = memory.rope.shift(q, -shift) if shift else q
    read = read_memory(memory, member.policy, layer, routed, scaling)
    positions = torch.cat([memory.fixed_positions[layer], memory.token_positions(read.slots)], 1)
    document = positions >= member.head  # (Hkv, E) entries after the template's head
    keys, bias = read.keys, read.bias
    if shift:
        keys = torch.where(document[..., None], memory.rope.shift(keys, shift), keys)
    if not member.read_head:
        bias = bias.masked_fill(~document, ABSENT)
    return MemoryRead(keys, read.values, bias, read.owner, read.slots)


def route(
    memory: SpanMemory, policy: ZoomPolicy, layer: int, q: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Which spans each KV head zooms for queries ``q`` (Hkv, G, Tq, D): (Hkv, N) bool.

    Records the decision in the policy's trace and tells its observer. Long documents are
    prefiltered (:func:`sekv_core.zoom.prefilter.candidates`): the router scores only the
    candidates.
    """
    Hkv, N = q.shape[0], memory.n_spans
    if N == 0:
        return torch.zeros(Hkv, 0, dtype=torch.bool, device=q.device)
    if policy.pinned is not None:
        return _pinned(memory, policy, layer, q, scaling)
    if policy.route_queries is not None and q.shape[2] > policy.route_queries:
        pick = torch.linspace(q.shape[2] - 1, 0, policy.route_queries).round().long()
        q = q[:, :, pick.flip(0).to(q.device)]  # evenly spaced, the last query included
    index = candidates(
        memory.rep_tables,
        layer,
        q,
        policy.budget,
        policy.prefilter_keep,
        policy.prefilter_spans,
        memory.rep_blocks if policy.prefilter_blocks else None,
    )
    scores = widen(_scores(policy.router, memory, index, layer, q, scaling), policy.neighbours)
    zoom, threshold = select(scores, memory.lengths, policy.budget, policy.margin)
    policy.trace.record(layer, memory.num_layers, zoom, scores, threshold, memory.lengths)
    if policy.observer is not None:
        policy.observer(policy, memory, layer, q, scaling, zoom)
    return zoom


def _pinned(
    memory: SpanMemory, policy: ZoomPolicy, layer: int, q: torch.Tensor, scaling: float
) -> torch.Tensor:
    """The pinned passages for every KV head. The decision is the same at every step, so the
    trace records it once per layer (score: the question's attention; threshold: the least of
    the pinned spans')."""
    Hkv = q.shape[0]
    zoom = policy.pinned.expand(Hkv, -1)
    if layer not in policy.pinned_recorded:
        policy.pinned_recorded.add(layer)
        scores = policy.pinned_scores.expand(Hkv, -1)
        floor = torch.where(policy.pinned, policy.pinned_scores, float("inf")).min()
        threshold = floor.expand(Hkv)  # no host sync (inf when nothing is pinned)
        policy.trace.record(layer, memory.num_layers, zoom, scores, threshold, memory.lengths)
    if policy.observer is not None:
        policy.observer(policy, memory, layer, q, scaling, zoom)
    return zoom


def widen(scores: torch.Tensor, neighbours: int) -> torch.Tensor:
    """Each span's score becomes the best of itself and ``neighbours`` spans on each side.

    scores : (H, N), spans in document order. A span that wins brings its neighbours with it:
    short spans then zoom a phrase with its surrounding words instead of isolated words that
    match the question's.
    """
    if neighbours <= 0 or scores.shape[1] < 2:
        return scores
    width = 2 * neighbours + 1
    pooled = torch.nn.functional.max_pool1d(scores[:, None].float(), width, 1, neighbours)
    return pooled[:, 0].to(scores.dtype)


def _scores(
    router: Router,
    memory: SpanMemory,
    index: torch.Tensor | None,
    layer: int,
    q: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """(Hkv, N) router scores; spans outside ``index`` (when given) score -inf."""
    if index is None:
        return router.scores(memory, layer, q, scaling)
    part = router.scores(memory.subset(layer, index), layer, q, scaling)  # (Hkv, K)
    scores = part.new_full((q.shape[0], memory.n_spans), float("-inf"))
    scores[:, index] = part
    return scores


def sekv_attention(model: torch.nn.Module) -> AbstractContextManager[None]:
    """Route the model's attention through :func:`sekv_attention_forward` inside the block."""
    return use_attention(model, NAME, sekv_attention_forward)
