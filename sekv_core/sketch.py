"""Routing sketch: a few numbers per span token that estimate the token's attention logits.

Routers need, for every span, the largest logit any current query gives one of its tokens. The
sketch keeps R numbers per span token and KV head (4-bit) and estimates

    q . k  =  q . mu  +  q . (k - mu)  ~=  q . mu  +  (q A) . ((k - mu) B)

with mu the head's mean span key (an exact term: it shifts every token's logit for a query by the
same amount, but it decides which *query* gives a span its best logit). A and B (D x R) come from
the document's own statistics. With Q the second moment of the head group's queries over the
context, W = Q^1/2 and C the centred key second moment, the mean squared error of the estimate
over those queries and keys is smallest for B = W U, A = W^-1 U, U the top R eigenvectors of
W C W: the directions that carry the logit's variance, not the keys' (a key direction the queries
never read costs nothing to drop). Without query statistics W = I: plain centred key PCA.

The store keeps the directions strongest first, so its first d directions are a d-dimensional
sketch (an answer under a tight memory target routes with the strongest half).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bitpack import pack_codes, unpack_codes
from .kvquant import STORE_DTYPE
from .native import kernels

RIDGE = 1e-4  # query directions below this share of the strongest one are floored (invertible W)


class QueryMoments:
    """Running second moment of the queries of each (layer, KV head group): sum of q q^T (kept
    on the queries' device; nothing is copied to the host until :meth:`moment` / :meth:`state`)."""

    def __init__(self) -> None:
        self.sums: dict[int, torch.Tensor] = {}
        self.counts: dict[int, int] = {}

    def add(self, layer: int, query: torch.Tensor, num_kv_heads: int) -> None:
        """query: (Hq, T, D) or (1, Hq, T, D) queries of one layer (post-RoPE)."""
        q = query.reshape(-1, *query.shape[-2:]).float()  # (Hq, T, D)
        flat = q.reshape(num_kv_heads, -1, q.shape[-1])  # (Hkv, G * T, D), groups contiguous
        moment = flat.transpose(1, 2) @ flat  # (Hkv, D, D)
        if layer in self.sums:
            self.sums[layer] = self.sums[layer].to(moment.device) + moment  # (resumed: on host)
            self.counts[layer] += flat.shape[1]
        else:
            self.sums[layer], self.counts[layer] = moment, flat.shape[1]

    def state(self) -> dict[str, torch.Tensor]:
        """Tensors to checkpoint (an empty dict before any query)."""
        if not self.sums:
            return {}
        layers = sorted(self.sums)
        return {
            "query_moment_sum": torch.stack([self.sums[i] for i in layers]).cpu(),
            "query_moment_count": torch.tensor([self.counts[i] for i in layers]),
        }

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor]) -> QueryMoments:
        out = cls()
        if "query_moment_sum" in tensors:
            sums, counts = tensors["query_moment_sum"], tensors["query_moment_count"]
            out.sums = {i: sums[i].clone() for i in range(sums.shape[0])}
            out.counts = {i: int(counts[i]) for i in range(sums.shape[0])}
        return out

    def moment(self) -> torch.Tensor | None:
        """(L, Hkv, D, D) mean q q^T, or None before any query was seen."""
        if not self.sums:
            return None
        return torch.stack([self.sums[i] / self.counts[i] for i in sorted(self.sums)]).cpu()


@dataclass
class SketchBasis:
    """query_proj A, key_proj B (L, H, D, R) and the mean span key mu (L, H, D)."""

    query_proj: torch.Tensor
    key_proj: torch.Tensor
    mean: torch.Tensor

    def project(self, keys: torch.Tensor) -> torch.Tensor:
        """Sketch rows (L, H, S, R) of keys (L, H, S, D) (before quantisation)."""
        return (keys - self.mean[:, :, None]) @ self.key_proj


def sketch_basis(keys: torch.Tensor, query_moment: torch.Tensor | None, dim: int) -> SketchBasis:
    """The sketch's projections for span keys (L, H, S, D), given the queries' second moment
    (L, H, D, D) (None: centred key PCA)."""
    keys = keys.float()
    mean = keys.mean(dim=2) if keys.shape[2] else keys.new_zeros(*keys.shape[:2], keys.shape[3])
    centred = keys - mean[:, :, None]
    cov = centred.transpose(-1, -2) @ centred  # (L, H, D, D)
    if query_moment is None:
        _, vecs = torch.linalg.eigh(cov)
        top = vecs[..., -dim:].flip(-1)
        return SketchBasis(top, top, mean)
    vals, vecs = torch.linalg.eigh(query_moment.float())
    vals = vals.clamp(min=1e-12).maximum(vals[..., -1:] * RIDGE)
    w = vecs @ torch.diag_embed(vals.sqrt()) @ vecs.transpose(-1, -2)  # Q^1/2 (symmetric)
    w_inv = vecs @ torch.diag_embed(vals.rsqrt()) @ vecs.transpose(-1, -2)
    _, u = torch.linalg.eigh(w @ cov @ w)
    top = u[..., -dim:].flip(-1)  # (L, H, D, R), strongest direction first
    return SketchBasis(w_inv @ top, w @ top, mean)


def quantize_sketch(sketch: torch.Tensor, bits: int = 4) -> dict[str, torch.Tensor]:
    """Quantise the sketch (L, H, S, R) with one fp16 scale per (layer, head, dim).

    bits = 8: int8 values. bits = 4: values in [-7, 7] packed two per byte (uint8, last dim R/2).
    """
    levels = 2 ** (bits - 1) - 1
    if sketch.shape[2]:
        scale = sketch.abs().amax(dim=2).clamp(min=1e-6) / levels  # (L, H, R)
    else:  # no span tokens (a document of a few tokens): any scale
        scale = sketch.new_ones(*sketch.shape[:2], sketch.shape[3])
    if bits not in (4, 8):
        raise ValueError(f"sketch bits must be 4 or 8, not {bits}")
    q = (sketch / scale[:, :, None]).round().clamp(-levels, levels)
    return {"sketch": pack_sketch(q, bits), "sketch_scale": scale.to(STORE_DTYPE)}


def dequantize_sketch(packed: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """(..., S, R) values of a quantised sketch (without the scale), in ``dtype``."""
    if packed.dtype == torch.int8:
        return packed.to(dtype)
    return unpack_codes(packed, 4)[..., :dim].to(dtype) - 8


def sketch_rows(memory, layer: int, dtype: torch.dtype, rows: torch.Tensor | None = None):
    """The sketch rows (H, S, R) of ``layer`` (``rows``: a subset) dequantised to ``dtype``,
    without their scale (see :func:`quantize_sketch`)."""
    packed = memory.sketch[layer] if rows is None else memory.sketch[layer][:, rows]
    return dequantize_sketch(packed, memory.sketch_proj[layer].shape[-1], dtype)


def sketch_logits(
    memory,
    layer: int,
    q: torch.Tensor,
    rows: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
):
    """Estimated logits (unscaled) (H, G, Tq, S) of queries ``q`` (H, G, Tq, D) for the sketch
    rows of ``layer`` (``rows``: a subset of them; ``values``: those rows already dequantised by
    :func:`sketch_rows`). ``memory`` holds ``sketch``, ``sketch_proj``, ``sketch_scale`` and
    ``sketch_mean`` per layer."""
    H, G, Tq, _ = q.shape
    qs, offset = sketch_queries(memory, layer, q)
    if values is not None:
        logits = torch.baddbmm(offset, qs, values.to(q.dtype).transpose(1, 2))
    else:
        packed = memory.sketch[layer] if rows is None else memory.sketch[layer][:, rows]
        logits = code_products(qs, packed, offset)
    return logits.view(H, G, Tq, -1)


def sketch_queries(memory, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``q`` (H, G, Tq, D) in the sketch's scaled directions (H, M, R) and their
    products with the mean key (H, M, 1), M = G * Tq: a sketch row's estimated logit is the
    first's product with its codes plus the second."""
    H, G, Tq, _ = q.shape
    proj = memory.sketch_proj[layer].to(q.dtype)  # (H, D, R)
    scale = memory.sketch_scale[layer].to(q.dtype)[:, None]  # (H, 1, R)
    flat = q.reshape(H, G * Tq, -1)
    qs = torch.bmm(flat, proj) * scale  # (H, M, R)
    offset = torch.bmm(flat, memory.sketch_mean[layer].to(q.dtype)[..., None])  # (H, M, 1)
    return qs, offset


def reads_natively(memory, layer: int, q: torch.Tensor) -> bool:
    """Whether the native kernels read ``layer``'s sketch for queries ``q``: a whole memory's
    4-bit sketch held column-major, float32 queries, on the CPU (:mod:`sekv_core.native.kernels`; a
    subset of a memory is read by the tensor code)."""
    first_row = getattr(memory, "first_row", None)  # a subset (prefilter) reads its own rows
    packed = memory.sketch[layer]
    return (
        first_row is not None
        and packed.dtype == torch.uint8
        and q.dtype == torch.float32
        and is_column_major(packed)
        and kernels.usable(packed.transpose(1, 2), first_row, memory.host_lengths)
    )


def column_major(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (..., S, C) as the same values stored with S contiguous: (..., C, S) in memory,
    seen as (..., S, C); no copy when they already are. Element-wise ops keep that layout, so
    :func:`code_products` multiplies by the rows' transpose reading contiguous memory (the
    routing step's largest read)."""
    return rows.transpose(-1, -2).contiguous().transpose(-1, -2)


def is_column_major(rows: torch.Tensor) -> bool:
    return rows.transpose(-1, -2).is_contiguous()


def code_products(
    qs: torch.Tensor, packed: torch.Tensor, offset: torch.Tensor | None = None
) -> torch.Tensor:
    """(H, M, S) products of ``qs`` (H, M, R) with the codes of sketch rows ``packed`` (H, S,
    ...) as :func:`quantize_sketch` stores them (without their scale), plus ``offset`` (H, M, 1)
    when given, without unpacking the rows: a byte's two 4-bit codes multiply the even and the
    odd directions of ``qs``. Constants per query are added inside the first product."""
    if packed.dtype == torch.int8:
        codes = packed.to(qs.dtype).transpose(1, 2)
        return torch.bmm(qs, codes) if offset is None else torch.baddbmm(offset, qs, codes)
    low, high = qs.unflatten(-1, (-1, 2)).unbind(-1)  # (H, M, R / 2) each
    base = qs.sum(dim=-1, keepdim=True) * -8  # codes are levels + 8
    if offset is not None:
        base = base + offset
    products = torch.baddbmm(base, low, (packed & 15).to(qs.dtype).transpose(1, 2))
    return products.baddbmm_(high, (packed >> 4).to(qs.dtype).transpose(1, 2))


def span_mean_keys(
    memory, layer: int, through: torch.Tensor | None = None, values: torch.Tensor | None = None
) -> torch.Tensor:
    """Each span's mean key as the sketch reconstructs it, mu + A mean((k - mu) B), (H, N, D); a
    query's logit with it is the mean of the span's estimated logits. With ``through``
    (H, G, D, K): those keys mapped by it, (H, G, N, K), differentiable in it, without forming
    the keys (the map is folded into A and applied to every sketch row first, so the per-span
    means run over K numbers per row, not D). ``memory`` as for :func:`sketch_logits`, plus
    ``lengths`` (N,); ``values``: the rows from :func:`sketch_rows`, if at hand."""
    proj = memory.sketch_proj[layer].float() * memory.sketch_scale[layer].float()[:, None]
    H, D, R = proj.shape
    rows = sketch_rows(memory, layer, torch.float32) if values is None else values.float()
    squeeze = through is None
    through = torch.eye(D, device=proj.device).expand(H, 1, D, D) if squeeze else through.float()
    G, K = through.shape[1], through.shape[3]
    folded = torch.einsum("hdr,hgdk->hgkr", proj, through).reshape(H, G * K, R)
    per_row = folded @ rows.transpose(1, 2)  # (H, G*K, S): wide last, where matmul is quick
    # spans hold consecutive rows: per-span sums from one running sum along the rows
    running = torch.nn.functional.pad(per_row.cumsum(dim=-1), (1, 0))
    lengths = memory.lengths
    ends = lengths.cumsum(0)
    means = (running[..., ends] - running[..., ends - lengths]) / lengths.clamp(min=1)
    base = torch.einsum("hd,hgdk->hgk", memory.sketch_mean[layer].float(), through)
    out = means.view(H, G, K, -1).transpose(2, 3) + base[:, :, None]  # (H, G, N, K)
    return out[:, 0] if squeeze else out


def span_representatives(
    surprisal: torch.Tensor, lengths: torch.Tensor, count: int = 4
) -> torch.Tensor:
    """Sketch rows of each span's ``count`` highest-surprisal tokens (names, numbers, the facts
    a question asks for): (N, count) int64, a short span repeating its best row.

    surprisal : (S,) of the span tokens in sketch-row order; lengths : (N,).
    """
    if not len(lengths):
        return torch.zeros(0, count, dtype=torch.long)
    first = torch.cumsum(lengths, 0) - lengths  # (N,)
    width = int(lengths.max())
    within = torch.arange(width)[None]  # (1, M)
    rows = (first[:, None] + within).clamp(max=max(len(surprisal) - 1, 0))  # (N, M)
    h = surprisal[rows] if len(surprisal) else torch.zeros(rows.shape)
    h = h.masked_fill(within >= lengths[:, None], float("-inf"))
    k = min(count, width)
    best = h.topk(k, dim=1).indices if k else torch.zeros(len(lengths), 0, dtype=torch.long)
    best = torch.minimum(best, (lengths[:, None] - 1).clamp(min=0))  # short spans: repeat
    reps = first[:, None] + best
    if k < count:
        reps = torch.cat([reps, reps[:, :1].expand(-1, count - k)], dim=1)
    return reps


def span_token_positions(starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """(S,) the context position of every span token (the sketch's rows), spans in order."""
    lengths = ends - starts
    first = torch.cumsum(lengths, 0) - lengths
    span = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return starts[span] + torch.arange(int(lengths.sum())) - first[span]


def segment_max(values: torch.Tensor, segment_ids: torch.Tensor, n: int) -> torch.Tensor:
    """Max of ``values`` (H, S) over segments given by ``segment_ids`` (S,) -> (H, n)."""
    out = values.new_full((values.shape[0], n), float("-inf"))
    index = segment_ids[None].expand_as(values)
    return out.scatter_reduce(1, index, values, reduce="amax", include_self=True)


def requantize_sketch(levels: torch.Tensor, ratio: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer sketch levels (L, H, S, R) moved to a larger scale: multiplied by ``ratio``
    (L, H, R), old scale / new scale, and rounded (see :func:`quantize_sketch`)."""
    top = 2 ** (bits - 1) - 1
    return (levels * ratio[:, :, None]).round().clamp(-top, top)


def pack_sketch(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer levels (..., R) in [-7, 7] / [-127, 127] -> the sketch's stored form (as
    :func:`quantize_sketch` packs them)."""
    if bits == 8:
        return levels.to(torch.int8)
    return pack_codes(levels + 8, 4)  # 1..15, two per byte (R/2)


def sketch_dtype(bits: int) -> torch.dtype:
    """The stored sketch's dtype: int8 at 8 bits, uint8 (two 4-bit values per byte) at 4."""
    return torch.int8 if bits == 8 else torch.uint8


def widen_sketch_scale(
    rows: torch.Tensor | None, scale: torch.Tensor, needed: torch.Tensor, headroom: float, bits: int
) -> torch.Tensor:
    """The scale (L, H, R) of a sketch that must also hold values of scale ``needed``: where that
    exceeds ``scale``, ``needed`` x ``headroom``, as stored (fp16). The rows (L, H, S, cols)
    quantised at ``scale`` (None: none yet) are requantised to it in place, only the (layer,
    head) pairs whose scale grew."""
    grown = torch.where(needed > scale, needed * headroom, scale)
    grown = grown.to(STORE_DTYPE).float()  # representable as stored
    if rows is not None:
        ratio = (scale / grown).to(rows.device)  # (L, H, R) <= 1
        layer, head = torch.nonzero((ratio < 1).any(dim=-1), as_tuple=True)
        levels = dequantize_sketch(rows[layer, head], scale.shape[-1], torch.float32)  # (n, S, R)
        again = requantize_sketch(levels[None], ratio[layer, head][None], bits)[0]
        rows[layer, head] = pack_sketch(again, bits)
    return grown


def sketch_state(basis: SketchBasis | None, moments: QueryMoments) -> dict[str, torch.Tensor]:
    """Tensors that checkpoint a sketch being built: its basis once fixed, else the moments of
    the queries seen so far (see :func:`sketch_from_state`)."""
    if basis is None:
        return moments.state()
    return {
        "sketch_query": basis.query_proj,
        "sketch_key": basis.key_proj,
        "sketch_mean": basis.mean,
    }


def sketch_from_state(tensors: dict[str, torch.Tensor]) -> tuple[SketchBasis | None, QueryMoments]:
    """The (basis, query moments) that :func:`sketch_state` checkpointed (no moments once the
    basis is fixed)."""
    if "sketch_query" in tensors:
        t = tensors
        return SketchBasis(t["sketch_query"], t["sketch_key"], t["sketch_mean"]), QueryMoments()
    return None, QueryMoments.from_state(tensors)
