import pytest
import torch

from sekv_core.codec import fit_code, load_code
from sekv_core.reflectors import BASES, check_bases, directions, reflected, rotation
from sekv_core.summary import STORE_DTYPE


def principal(seed: int = 0, shape=(2, 3, 64)) -> torch.Tensor:
    """Eigenvectors (..., D, D) of correlated rows, strongest first (what codes are fitted on)."""
    g = torch.Generator().manual_seed(seed)
    *batch, D = shape
    mix = torch.randn(*batch, D, D, generator=g) * torch.logspace(0, -2, D)
    rows = torch.randn(*batch, 200, D, generator=g) @ mix
    _, vecs = torch.linalg.eigh(rows.transpose(-1, -2) @ rows)
    return vecs.flip(-1)


def test_a_basis_is_kept_as_half_the_numbers_and_makes_an_orthogonal_basis_near_the_original():
    vecs = principal()
    stored = reflected(vecs)
    D = vecs.shape[-1]
    assert stored.dtype == torch.int8 and stored.shape == vecs.shape
    assert not stored.triu(1).any()  # only geqrf's lower half: D(D-1)/2 numbers, not D^2
    basis = rotation(stored)
    assert torch.equal(basis, basis.to(STORE_DTYPE).float())  # fp16 numbers, as a store keeps
    eye = torch.eye(D)
    assert (basis.transpose(-1, -2) @ basis - eye).abs().max() < 3e-3  # orthogonal (fp16)
    cosine = (basis * vecs).sum(dim=-2).abs()  # each direction against the document's own
    assert cosine.min() > 0.98 and (1 - cosine).mean() < 1e-3


def test_a_load_makes_the_directions_the_build_coded_with():
    vecs = principal(1)
    stored, basis = directions(vecs)
    assert torch.equal(rotation(stored.clone()), basis)
    rows = torch.randn(2, 3, 300, 64) @ torch.randn(64, 64)
    for spec in ("even:0.175", "*x4", "alloc:4"):
        code = fit_code(rows, spec)
        tensors = code.tensors("k")
        assert tensors["k_basis"].dtype == torch.int8
        again = load_code(tensors, "k", spec)
        assert torch.equal(again.basis, code.basis), spec
        records = code.encode(rows)
        decoded = again.decode(records[1].reshape(-1, records.shape[-1]), 1, [300] * 3, torch.float)
        assert torch.equal(
            decoded, code.decode(records[1].reshape(3 * 300, -1), 1, [300] * 3, torch.float)
        ), spec


def test_an_empty_code_still_has_a_basis_of_the_stored_form():
    code = fit_code(torch.zeros(2, 3, 0, 16), "even:0.175")
    assert code.reflectors.dtype == torch.int8
    assert torch.equal(code.basis.abs(), torch.eye(16).expand(2, 3, 16, 16))


def test_a_malformed_basis_is_refused():
    stored = reflected(principal(2, (1, 2, 16)))
    check_bases({"k_basis": stored, "v_basis": stored})
    upper = stored.clone()
    upper[0, 0, 0, 5] = 3
    fp16 = stored.to(STORE_DTYPE)
    exponent = stored.clone()
    exponent[0, 1, 4, 4] = 20
    for bad, reason in ((upper, "malformed"), (fp16, "8-bit"), (exponent, "malformed")):
        for name in BASES:
            with pytest.raises(ValueError, match=f"{name}: .*{reason}"):
                check_bases({name: bad})
        with pytest.raises(ValueError, match=reason):
            rotation(bad)
