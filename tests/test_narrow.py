import pytest
import torch

from sekv_core.narrow import EXP, NARROWED, narrow, narrowed, widen
from sekv_core.summary import STORE_DTYPE


def matrices(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, 3, 16, 8)  # (L, H, D, C)
    out = {
        name: torch.randn(shape, generator=g) * 10.0 ** (i - 2) for i, name in enumerate(NARROWED)
    }
    out["k_basis"][0, 0, :, 3] = 0.0  # a zero column
    return out


def test_the_file_holds_codes_and_a_load_reads_the_numbers_the_build_used():
    built = {name: narrowed(t).to(STORE_DTYPE) for name, t in matrices().items()}
    for name, t in matrices().items():  # exact in half precision
        assert torch.equal(built[name].float(), narrowed(t)), name
    on_disk = narrow({**built, "other": torch.ones(3)})
    for name in NARROWED:
        assert on_disk[name].dtype == torch.int8 and on_disk[name + EXP].dtype == torch.int8
        assert on_disk[name].abs().max() <= 127
        assert on_disk[name].abs().amax(dim=-2).min() >= 64 or name == "k_basis"  # grid used
    assert sum(t.nbytes for t in on_disk.values()) < 0.6 * sum(t.nbytes for t in built.values())
    widen(on_disk)
    assert set(on_disk) == {*NARROWED, "other"}
    for name in NARROWED:
        assert on_disk[name].dtype == STORE_DTYPE and torch.equal(on_disk[name], built[name])


def test_the_grid_is_fine_and_rounding_twice_changes_nothing():
    for name, t in matrices(1).items():
        once = narrowed(t)
        assert torch.equal(narrowed(once), once), name
        largest = t.abs().amax(dim=-2, keepdim=True)
        assert ((once - t).abs() <= largest / 127 + 1e-12).all(), name  # half a step, at most


def test_a_malformed_matrix_is_refused():
    stored = narrow({"k_basis": matrices()["k_basis"]})
    missing = {"k_basis": stored["k_basis"]}
    with pytest.raises(ValueError, match="8-bit"):
        widen(missing)
    wrong = {"k_basis": stored["k_basis"], "k_basis" + EXP: stored["k_basis" + EXP][..., :2]}
    with pytest.raises(ValueError, match="exponents"):
        widen(wrong)
    fp16 = {"k_basis": torch.zeros(2, 3, 16, 8, dtype=STORE_DTYPE)}
    with pytest.raises(ValueError, match="8-bit"):
        widen(fp16)
