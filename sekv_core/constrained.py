"""The store's fixed matrices coded by the equations they satisfy, losslessly.

Two kinds of a store's per-(layer, KV head) matrices carry structure that plain LZMA cannot see:

- A codebook's basis (``k_basis``, ``v_basis``: 8-bit codes, :mod:`sekv_core.narrow`) has
  orthonormal columns: column j is orthogonal to the j before it, j linear equations. Given
  those columns and 64 - j of column j's entries, the equations give the other j entries to
  within the rounding of the codes (residuals of about one code step, where the codes spread
  over ±127).
- The sketch's projections A (``sketch_proj``) and B (``sketch_key``; fp16, (D, R)) satisfy
  A^T B = I (:mod:`sekv_core.sketch`: A = W^-1 U, B = W U): given A and D - R rows of B, the
  R × R equations give B's other R rows to within a few fp16 steps.

So a file keeps each such matrix as the entries the equations leave free and, for the entries
they fix, the difference between the stored number and the one the equations predict. The
fitted rows are chosen by Gaussian elimination with partial pivoting (for a basis, column by
column, as the decoder learns the columns; for B, of A), and encoding and decoding make the
same predictions from the same numbers in float64 on the host, so the matrices come back bit
for bit: nothing an answer reads changes, and the lighthouse story's store sheds 0.012 of its
fp16 cache (a quarter of these matrices' bytes) for ~0.07 s more per load. A checksum of the
decoded matrices refuses a store whose predictions came out otherwise (another machine's
arithmetic), rather than use it.
"""

from __future__ import annotations

import math
import zlib

import torch

BASES = ("k_basis", "v_basis")  # (L, H, D, D) int8 codes; columns are the directions
SKETCH = ("sketch_proj", "sketch_key")  # A, B (L, H, D, R) fp16 with A^T B = I
FREE, FIT = "_free", "_fit"  # suffixes: the free entries, the residuals of the fitted ones
CHECK = "constrained_crc"  # CRC-32 of the decoded matrices (int64, one number)
LEVELS = 127  # the bases' codes lie in ±LEVELS (sekv_core.narrow)


def constrain(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each basis of 8-bit codes and the sketch's B (fp16, given A) as free
    entries and residuals (:data:`FREE`, :data:`FIT`), and the :data:`CHECK` of what they
    decode to. Matrices of other forms are left as they are."""
    out, coded = dict(tensors), []
    for name in BASES:
        codes = out.get(name)
        if codes is not None and codes.dtype == torch.int8 and codes.shape[-1] == codes.shape[-2]:
            codes = out.pop(name).cpu()  # (the host's arithmetic, as a load's)
            out[name + FREE], out[name + FIT] = _basis_split(codes)
            coded.append(codes)
    a, b = (out.get(name) for name in SKETCH)
    if _sketch_form(a, b):
        a, b = a.cpu(), out.pop(SKETCH[1]).cpu()
        out[SKETCH[1] + FREE], out[SKETCH[1] + FIT] = _sketch_split(a, b)
        coded.append(b)
    if coded:
        out[CHECK] = torch.tensor([_crc(coded)])
    return out


def unconstrain(tensors: dict[str, torch.Tensor]) -> None:
    """The matrices :func:`constrain` coded, back in place; ValueError where the pieces do not
    fit their shapes or do not decode to the matrices the file was written from."""
    coded = []
    for name in BASES:
        if name + FIT not in tensors:
            continue
        exp = tensors.get(name + "_exp")  # (..., 1, D): the basis's shape
        if exp is None:
            raise ValueError(f"{name} is coded without its exponents")
        shape = (*exp.shape[:-2], exp.shape[-1], exp.shape[-1])
        tensors[name] = _basis_join(_pop(tensors, name + FREE), _pop(tensors, name + FIT), shape)
        coded.append(tensors[name])
    if SKETCH[1] + FIT in tensors:
        a = tensors.get(SKETCH[0])
        if a is None or a.dtype != torch.float16 or a.dim() < 2 or a.shape[-1] > a.shape[-2]:
            raise ValueError("the sketch's key projection is coded without its query projection")
        free, fit = _pop(tensors, SKETCH[1] + FREE), _pop(tensors, SKETCH[1] + FIT)
        tensors[SKETCH[1]] = _sketch_join(a, free, fit)
        coded.append(tensors[SKETCH[1]])
    check = tensors.pop(CHECK, None)
    if coded and (check is None or check.numel() != 1 or int(check) != _crc(coded)):
        raise ValueError("the coded matrices do not decode to the ones stored (rebuild it)")


def _pop(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"{name} is missing")
    return tensors.pop(name)


def _crc(matrices: list[torch.Tensor]) -> int:
    crc = 0
    for t in matrices:
        crc = zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return crc


# --- bases: orthogonal columns -------------------------------------------------------------


def _basis_split(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (..., D, D) int8 -> the free entries (..., D(D+1)/2) int8 and the residuals
    (..., D(D-1)/2) of the fitted ones (:func:`_folded`), column after column, each column's
    in the order of :attr:`_Orthogonal.rows`."""
    lead, d = codes.shape[:-2], codes.shape[-1]
    flat = codes.reshape(-1, d, d).double()
    equations, free, fit = _Orthogonal(len(flat), d), [], []
    for j in range(d):
        col = flat[:, :, j]
        free.append(col.gather(1, equations.free))
        fit.append(col.gather(1, equations.pivots) - equations.predict(col))
        equations.add(col)
    return torch.cat(free, dim=1).to(torch.int8).reshape(*lead, -1), _folded(
        torch.cat(fit, dim=1), lead
    )


def _basis_join(free: torch.Tensor, fit: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The codes (``shape``: ..., D, D) int8 :func:`_basis_split` split."""
    d = shape[-1]
    n = math.prod(shape[:-2])
    if free.dtype != torch.int8 or free.numel() != n * d * (d + 1) // 2:
        raise ValueError("a basis's free entries do not fit its shape")
    if fit.numel() != n * d * (d - 1) // 2:
        raise ValueError("a basis's residuals do not fit its shape")
    free, fit = free.reshape(n, -1).double(), _unfolded(fit).reshape(n, -1).double()
    equations, columns, at = _Orthogonal(n, d), [], 0
    for j in range(d):
        col = torch.zeros(n, d, dtype=torch.float64)
        col.scatter_(1, equations.free, free[:, at : at + d - j])
        at += d - j
        fitted = fit[:, j * (j - 1) // 2 : j * (j + 1) // 2] + equations.predict(col)
        col.scatter_(1, equations.pivots, fitted)
        equations.add(col)
        columns.append(col)
    out = torch.stack(columns, dim=-1)
    if out.numel() and out.abs().amax() > LEVELS:
        raise ValueError("a basis's coded entries decode beyond its codes' range")
    return out.to(torch.int8).reshape(shape)


class _Orthogonal:
    """The equations the next column of n bases (D rows) satisfies: orthogonal to the j
    columns added so far, in reduced row echelon form. Each added column takes a pivot row (of
    what is left of it after the earlier equations, the largest entry: partial pivoting), and
    the equations read v[pivots] = -K^T v[free], K (n, D - j, j). Encoding and decoding run
    this same arithmetic, in float64."""

    def __init__(self, n: int, d: int) -> None:
        self.rows = torch.arange(d).expand(n, d).contiguous()  # pivots in order, then free
        self.K = torch.zeros(n, d, 0, dtype=torch.float64)
        self.j, self.n = 0, torch.arange(n)

    @property
    def pivots(self) -> torch.Tensor:
        return self.rows[:, : self.j]

    @property
    def free(self) -> torch.Tensor:
        return self.rows[:, self.j :]

    def predict(self, col: torch.Tensor) -> torch.Tensor:
        """The codes (n, j) at :attr:`pivots` of a column (n, D) whose :attr:`free` rows are
        given, orthogonal to the columns added."""
        at = -(self.K * col.gather(1, self.free)[:, :, None]).sum(dim=1)
        return at.nan_to_num(0.0, 0.0, 0.0).round().clamp(-LEVELS, LEVELS)

    def add(self, col: torch.Tensor) -> None:
        """One more column (n, D): its equation reduced by the others, a new pivot row."""
        on = col.gather(1, self.pivots)
        left = col.gather(1, self.free) - (self.K * on[:, None, :]).sum(dim=2)  # (n, D - j)
        best = left.abs().argmax(dim=1)  # (a free row, even where all are 0)
        top = left[self.n, best][:, None]
        step = torch.where(top == 0, 0.0, left / torch.where(top == 0, 1.0, top))  # best: 1
        K = self.K - step[:, :, None] * self.K[self.n, best][:, None, :]  # best's row: 0
        # best's row moves to the front of the free rows, then joins the pivots
        swap = torch.arange(left.shape[1]).expand_as(left).clone()
        swap[self.n, best], swap[:, 0] = 0, best
        K, step = K.gather(1, swap[:, :, None].expand_as(K)), step.gather(1, swap)
        self.rows[:, self.j :] = self.free.gather(1, swap)
        self.K = torch.cat([K[:, 1:], step[:, 1:, None]], dim=2)
        self.j += 1


def _folded(residuals: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    """Integer residuals (n, k) as (..., k) non-negative numbers (0, -1, 1, -2, ... -> 0, 1, 2,
    3, ...: a small residual's sign in its lowest bit, so its higher bytes are zeros) in the
    narrowest of uint8, int16 and int32 that holds them."""
    r = residuals.long()
    folded = torch.where(r < 0, -2 * r - 1, 2 * r)
    top = int(folded.amax()) if folded.numel() else 0
    dtype = torch.uint8 if top < 256 else torch.int16 if top < 2**15 else torch.int32
    return folded.to(dtype).reshape(*lead, -1)


def _unfolded(folded: torch.Tensor) -> torch.Tensor:
    """The residuals (int64) :func:`_folded` folded; ValueError for other types or signs."""
    if folded.dtype not in (torch.uint8, torch.int16, torch.int32):
        raise ValueError("coded residuals have the wrong type")
    f = folded.long()
    if f.numel() and f.amin() < 0:
        raise ValueError("coded residuals are negative")
    return torch.where(f % 2 == 1, -(f + 1) // 2, f // 2)


# --- the sketch's projections: A^T B = I ----------------------------------------------------


def _sketch_form(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (
        a is not None
        and b is not None
        and a.dtype == b.dtype == torch.float16
        and a.shape == b.shape
        and a.dim() >= 2
        and a.shape[-1] <= a.shape[-2]
    )


def _sketch_rows(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For A (n, D, R): the rows of B its equations fit (n, R: A's pivot rows), B's free rows
    (n, D - R) and the factors of A's rows in that order (L11, L21, U) that predict them."""
    x = a.double()
    lu, pivots, _ = torch.linalg.lu_factor_ex(x)  # singular A: predictions only worse
    perm_matrix, lower, upper = torch.lu_unpack(lu, pivots)  # A = P L U
    perm = perm_matrix.transpose(1, 2).argmax(dim=2)  # row i of P^T A is A[perm[i]]
    r = x.shape[-1]
    return perm[:, :r], perm[:, r:], (lower[:, :r], lower[:, r:], upper)


def _sketch_predict(factors: tuple, free_b: torch.Tensor) -> torch.Tensor:
    """B's fitted rows (n, R, R) from its free rows (n, D - R, R): L11^T B_fit = U^-T - L21^T
    B_free, from A^T B = I with A's rows permuted into L U."""
    l11, l21, upper = factors
    eye = torch.eye(upper.shape[-1], dtype=torch.float64).expand_as(upper)
    inv_t = torch.linalg.solve_triangular(upper.transpose(1, 2), eye, upper=False)
    rhs = inv_t - l21.transpose(1, 2) @ free_b
    out = torch.linalg.solve_triangular(l11.transpose(1, 2), rhs, upper=True, unitriangular=True)
    return out.nan_to_num(0.0, 0.0, 0.0).clamp(-65504, 65504).to(torch.float16)


def _sketch_split(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """B (..., D, R) fp16 -> its free rows (..., D - R, R) fp16 and the fitted rows' residuals
    (..., R * R) in fp16's ordered bit patterns (:func:`_folded`), given A."""
    lead, (d, r) = a.shape[:-2], a.shape[-2:]
    flat_b = b.reshape(-1, d, r)
    fitted, free, factors = _sketch_rows(a.reshape(-1, d, r))
    free_b = flat_b.gather(1, free[:, :, None].expand(-1, -1, r))
    predicted = _sketch_predict(factors, free_b.double())
    actual = flat_b.gather(1, fitted[:, :, None].expand(-1, -1, r))
    residual = _ordered(actual) - _ordered(predicted)
    return free_b.reshape(*lead, d - r, r), _folded(residual.reshape(-1, r * r), lead)


def _sketch_join(a: torch.Tensor, free_b: torch.Tensor, fit: torch.Tensor) -> torch.Tensor:
    """B (..., D, R) fp16 that :func:`_sketch_split` split, given A."""
    lead, (d, r) = a.shape[:-2], a.shape[-2:]
    if free_b.dtype != torch.float16 or free_b.shape != (*lead, d - r, r):
        raise ValueError("the sketch's key projection's free rows do not fit its shape")
    if fit.shape != (*lead, r * r):
        raise ValueError("the sketch's key projection's residuals do not fit its shape")
    flat_a = a.reshape(-1, d, r)
    n = len(flat_a)
    fitted, free, factors = _sketch_rows(flat_a)
    free_b = free_b.reshape(n, d - r, r)
    predicted = _sketch_predict(factors, free_b.double())
    actual = _from_ordered(_unfolded(fit).reshape(n, r, r) + _ordered(predicted))
    out = torch.empty(n, d, r, dtype=torch.float16)
    out.scatter_(1, free[:, :, None].expand(-1, -1, r), free_b)
    out.scatter_(1, fitted[:, :, None].expand(-1, -1, r), actual)
    return out.reshape(*lead, d, r)


def _ordered(h: torch.Tensor) -> torch.Tensor:
    """fp16 numbers -> int32 in the order of their values (bit patterns, one to one)."""
    bits = h.contiguous().view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF) - 1, bits)


def _from_ordered(o: torch.Tensor) -> torch.Tensor:
    """The fp16 numbers :func:`_ordered` mapped to ``o``; ValueError beyond fp16's patterns."""
    if o.numel() and (o.amin() < -32768 or o.amax() > 32767):
        raise ValueError("the sketch's coded key projection decodes beyond half precision")
    bits = torch.where(o < 0, (-o - 1) | 0x8000, o)
    return bits.to(torch.int16).view(torch.float16)
