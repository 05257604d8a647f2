"""The decode step's kernels on the CPU (:mod:`sekv_core.native.build`), one typed call each.

Each takes and returns torch tensors on the CPU (callers check :func:`usable` first; the tensor
code runs elsewhere) and checks the sizes the C code trusts. Routing: :func:`select`,
:func:`sketch_scores`, :func:`gate_scores`, :func:`record`; the zoom pool:
:func:`new_pairs`, :func:`place`, :func:`activate`; zoom-in reads: :func:`gather`,
:func:`field_codes`, :func:`tier_coefficients`, :func:`rotate`; attention: :func:`entries`,
:func:`attention_trace`.
"""

from __future__ import annotations

import torch

from .build import library, usable

__all__ = ["usable"]


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _require(ok: bool, what: str) -> None:
    """The kernels trust their arrays' sizes: a caller's mistake stops here, not in memory."""
    if not ok:
        raise ValueError(f"native kernel called with {what}")


def select(
    scores: torch.Tensor, lengths: torch.Tensor, budget: int, margin: float | None, rounds: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sekv_core.zoom.router.select` for float32 scores (H, N) and int64 lengths (N,) on the
    CPU."""
    H, N = scores.shape
    _require(lengths.shape == (N,), "one length per span")
    zoom = torch.empty(H, N, dtype=torch.bool)
    threshold = torch.empty(H)
    failed = library().sekv_select(
        _ptr(scores),
        H,
        N,
        _ptr(lengths),
        budget,
        margin is not None,
        0.0 if margin is None else margin,
        rounds,
        _ptr(zoom),
        _ptr(threshold),
    )
    if failed:
        raise MemoryError("out of memory in select")
    return zoom, threshold


def record(
    zoomed: torch.Tensor,
    best_margin: torch.Tensor,
    best_score: torch.Tensor,
    tokens_max: torch.Tensor,
    zoom: torch.Tensor,
    scores: torch.Tensor,
    threshold: torch.Tensor,
    lengths: torch.Tensor,
) -> None:
    """The per-step part of :meth:`sekv_core.zoom.trace.ZoomTrace.record`, in place: ``zoomed``
    (H, N) bool, ``best_margin`` and ``best_score`` (N,) float32, ``tokens_max`` () int64."""
    H, N = zoom.shape
    library().sekv_record(
        _ptr(zoom),
        _ptr(scores),
        _ptr(threshold),
        H,
        N,
        _ptr(lengths),
        _ptr(zoomed),
        _ptr(best_margin),
        _ptr(best_score),
        _ptr(tokens_max),
    )


def new_pairs(
    zoom: torch.Tensor, held: torch.Tensor, owner: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The picked (span, head) pairs a pool does not hold, head-major: heads and spans (n,)
    int64, and the most slots one head needs (its held picked spans' and the new tokens)."""
    H, N = zoom.shape
    heads = torch.empty(H * N, dtype=torch.long)
    spans = torch.empty(H * N, dtype=torch.long)
    needed = torch.zeros((), dtype=torch.long)
    n = library().sekv_pairs(
        _ptr(zoom),
        _ptr(held),
        _ptr(owner),
        H,
        N,
        owner.shape[1],
        _ptr(lengths),
        _ptr(heads),
        _ptr(spans),
        _ptr(needed),
    )
    return heads[:n], spans[:n], int(needed)


def place(pool, zoom: torch.Tensor, heads, spans, lengths, first_row, k, v) -> None:
    """The slot bookkeeping of :meth:`sekv_core.zoom.pools.ZoomPool.place_new_spans` for an 8-bit
    pool of CPU tensors, in place: new rows ``k``, ``v`` (T, D) float32 in pair order."""
    owner, (codes, scale) = pool.owner, pool.rows.tensors()
    (H, C), D = owner.shape, codes.shape[-1]
    _require(k.shape == v.shape and k.shape[1:] == (D,), "rows of the pool's width")
    _require(heads.shape == spans.shape and codes.shape == (2, H, C, D), "a pool's layout")
    failed = library().sekv_place(
        H,
        zoom.shape[1],
        C,
        D,
        _ptr(zoom),
        _ptr(pool.held),
        _ptr(owner),
        _ptr(pool.last),
        _ptr(pool.token),
        heads.numel(),
        _ptr(heads),
        _ptr(spans),
        _ptr(lengths),
        _ptr(first_row),
        k.shape[0],
        _ptr(k),
        _ptr(v),
        _ptr(codes),
        _ptr(scale),
    )
    _require(failed != -2, "rows other than the pairs' tokens")
    if failed:
        raise MemoryError("out of memory placing zoomed rows")


def activate(
    zoom: torch.Tensor, owner: torch.Tensor, last: torch.Tensor, update: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots of picked spans (H, C) bool and attention's bias over the slots (0 there, the
    float32 minimum elsewhere); their ``last`` use set to ``update`` in place."""
    H, C = owner.shape
    active = torch.empty(H, C, dtype=torch.bool)
    bias = torch.empty(H, C)
    library().sekv_activate(
        _ptr(zoom),
        _ptr(owner),
        H,
        zoom.shape[1],
        C,
        update,
        _ptr(last),
        _ptr(active),
        _ptr(bias),
        torch.finfo(torch.float32).min,
    )
    return active, bias


def gather(
    index,
    layer: int,
    spans: torch.Tensor,
    heads: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    k_bytes: int,
    v_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]] | None:
    """The records (T, bytes) of keys and values of (span, head) pairs of ``layer`` (heads
    ascending) from the flat offload buffers, each row's context position (T,) and the rows of
    each KV head; None when the heads are not ascending. A record out of range (a store that
    does not match its span table) is an error. ``index``: the spans' records
    (:class:`sekv_core.zoom.reconstruct.RecordIndex`)."""
    lengths = index.lengths
    T = int(lengths[spans].sum())
    k_out = torch.empty(T, k_bytes, dtype=torch.uint8)
    v_out = torch.empty(T, v_bytes, dtype=torch.uint8)
    pos = torch.empty(T, dtype=torch.long)
    head_rows = torch.empty(index.num_kv_heads, dtype=torch.long)
    rows = library().sekv_gather(
        spans.numel(),
        _ptr(spans),
        _ptr(heads),
        layer,
        index.num_kv_heads,
        _ptr(index.record0),
        _ptr(index.stride),
        _ptr(lengths),
        _ptr(index.starts),
        index.context_len,
        _ptr(k_buf),
        k_buf.numel() // k_bytes,
        k_bytes,
        _ptr(v_buf),
        v_buf.numel() // v_bytes,
        v_bytes,
        _ptr(k_out),
        _ptr(v_out),
        _ptr(pos),
        _ptr(head_rows),
    )
    if rows == -1:
        return None
    if rows != T:
        raise RuntimeError("a zoomed span's records lie outside the offload tier")
    return k_out, v_out, pos, head_rows.tolist()


def field_codes(records: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Codes (T, D) float32 of an allocated code's records (T, B) uint8, ``bits`` (D,) int64
    per direction (:meth:`sekv_core.store.codes.EvenCode.decode`)."""
    (T, B), D = records.shape, bits.numel()
    _require(D <= 256 and B >= 1, "a record's directions do not fit the native decoder")
    out = torch.empty(T, D)
    library().sekv_field_codes(_ptr(records), T, B, D, _ptr(bits), _ptr(out))
    return out


def tier_coefficients(records: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Coefficients (T, dim) float32 of a tier code's records (T, B) uint8 at ``bits`` (4: the
    codes then a scale, B = dim / 2 + 2; 16: fp16 coefficients, B = 2 dim)
    (:meth:`sekv_core.store.codes.TierCode.coefficients`)."""
    T, B = records.shape
    size = {4: dim // 2 + 2, 16: 2 * dim}.get(bits)
    _require(B == size and dim <= 256, "records not of their code's size")
    out = torch.empty(T, dim)
    library().sekv_tier_coefficients(_ptr(records), T, B, dim, bits, _ptr(out))
    return out


def sketch_scores(
    q: torch.Tensor,
    sketch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    scaling: float,
    first_row: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor:
    """(H, N) each span's best estimated logit (:class:`sekv_core.zoom.router.SketchRouter`) for the
    queries ``q`` (H, G, Tq, D) of one layer; ``sketch`` as for :func:`gate_scores`."""
    (H, G, Tq, D), N = q.shape, first_row.numel()
    proj, scale, mean, packed = sketch
    R, S = proj.shape[-1], packed.shape[1]
    _require(q.is_contiguous() and lengths.shape == (N,), "spans")
    _require(proj.shape == (H, D, R) and scale.shape == (H, R) and mean.shape == (H, D), "sketch")
    _require(packed.shape == (H, S, R // 2), "a sketch's layout")
    out = torch.empty(H, N)
    failed = library().sekv_sketch_scores(
        _ptr(q),
        *(H, G * Tq, D),
        *map(_ptr, (proj, scale, mean)),
        R,
        _ptr(packed),
        S,
        scaling,
        N,
        _ptr(first_row),
        _ptr(lengths),
        _ptr(out),
    )
    _require(failed != -2, "spans outside the sketch")
    if failed:
        raise MemoryError("out of memory scoring spans")
    return out


def gate_scores(
    q: torch.Tensor,
    sketch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    first_row: torch.Tensor,
    lengths: torch.Tensor,
    gate: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    scaling: float,
) -> torch.Tensor:
    """(H, N) :class:`sekv_core.zoom.router.TrainedRouter`'s scores: each span's largest gate logit
    over the queries ``q`` (H, G, Tq, D) of one layer, in one pass over its 4-bit sketch.

    sketch : the layer's ``proj`` (H, D, R), ``scale`` (H, R), ``mean`` (H, D) and packed codes
    (H, S, R / 2) held column-major; first_row, lengths : (N,) each span's rows;
    gate : the routing maps (H, G, D, K), the spans' mapped mean keys (H, G, N, K), the weights
    (H, G, 5) of peak, mass, route term, log length and threshold, and log lengths (N,)."""
    (H, G, Tq, D), N = q.shape, first_row.numel()
    proj, scale, mean, packed = sketch
    route, keys, coef, log_len = gate
    R, S, K = proj.shape[-1], packed.shape[1], route.shape[-1]
    _require(q.is_contiguous() and lengths.shape == (N,) and log_len.shape == (N,), "spans")
    _require(proj.shape == (H, D, R) and scale.shape == (H, R) and mean.shape == (H, D), "sketch")
    _require(packed.shape == (H, S, R // 2), "a sketch's layout")
    _require(route.shape == (H, G, D, K) and keys.shape == (H, G, N, K), "routing maps")
    _require(coef.shape == (H, G, 5), "gate weights")
    out = torch.empty(H, N)
    failed = library().sekv_gate_scores(
        _ptr(q),
        *(H, G, Tq, D),
        *map(_ptr, (proj, scale, mean)),
        R,
        _ptr(packed),
        S,
        N,
        *map(_ptr, (first_row, lengths, route, keys)),
        K,
        _ptr(coef),
        _ptr(log_len),
        scaling,
        _ptr(out),
    )
    _require(failed != -2, "spans outside the sketch")
    if failed:
        raise MemoryError("out of memory scoring spans")
    return out


def rotate(keys: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Keys (T, D) float32 rotated to ``positions`` (T,) with RoPE's ``table`` (n, 2D) of cos |
    sin per position (:meth:`sekv_core.rope.Rope.rotate`): k cos + rotate_half(k) sin."""
    (T, D), n = keys.shape, table.shape[0]
    _require(table.shape[1:] == (2 * D,) and positions.shape == (T,), "a rotary table")
    out = torch.empty_like(keys)
    if library().sekv_rotate(_ptr(keys), _ptr(positions), _ptr(table), T, D, n, _ptr(out)):
        raise IndexError("a position outside the rotary table")
    return out


def entries(fixed_k, fixed_v, pool_rows, pool_bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The memory entries of one attention call, float32: K, V (H, F + C, D) of this layer's
    8-bit sinks and anchors (``fixed_k``, ``fixed_v``: Rows (H, F, D)) then the pool's slots
    (``pool_rows``: Rows (2, H, C, D)), and the bias (H, F + C): 0, then ``pool_bias`` (H, C)."""
    (H, F, D), C = fixed_k.codes.shape, pool_bias.shape[1]
    _require(pool_rows.codes.shape == (2, H, C, D), "a pool's layout")
    k = torch.empty(H, F + C, D)
    v = torch.empty(H, F + C, D)
    bias = torch.empty(H, F + C)
    library().sekv_entries(
        *(_ptr(t) for t in (*fixed_k.tensors(), *fixed_v.tensors(), *pool_rows.tensors())),
        _ptr(pool_bias),
        H,
        F,
        C,
        D,
        _ptr(k),
        _ptr(v),
        _ptr(bias),
    )
    return k, v, bias


def attention_trace(
    mass: torch.Tensor,
    fixed: int,
    q_heads: int,
    owner: torch.Tensor,
    span_mass: torch.Tensor,
    token: torch.Tensor,
    fixed_positions: torch.Tensor,
    span_positions: torch.Tensor,
    answer: torch.Tensor | None,
) -> None:
    """One decoding step's attention (H, E) over the memory entries into the trace, in place:
    each pool slot's share to its span's ``span_mass`` (N + 1,) and, with ``answer`` (H, T + 1),
    the most attention each context token got (:meth:`sekv_core.zoom.trace.ZoomTrace.add_step`)."""
    (H, C), N, S = owner.shape, span_mass.numel() - 1, span_positions.numel() - 1
    _require(mass.shape == (H, fixed + C) and fixed_positions.shape == (H, fixed), "entries")
    T = answer.shape[1] - 1 if answer is not None else 0
    failed = library().sekv_attention_trace(
        _ptr(mass),
        H,
        fixed,
        C,
        q_heads,
        _ptr(owner),
        N,
        _ptr(span_mass),
        _ptr(token),
        _ptr(fixed_positions),
        _ptr(span_positions),
        S,
        T,
        None if answer is None else _ptr(answer),
    )
    if failed:
        raise IndexError("an attention entry's position lies outside the document")
