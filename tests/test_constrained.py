import pytest
import torch

from sekv_core.constrained import CHECK, FIT, FREE, constrain, unconstrain
from sekv_core.narrow import EXP, narrow, narrowed
from sekv_core.packed import pack
from sekv_core.sketch import sketch_basis
from sekv_core.summary import STORE_DTYPE


def keys(seed: int, shape=(2, 3, 400, 64)) -> torch.Tensor:
    """Rows with a decaying spectrum and a few strong dimensions, as a head's keys have."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(1, -2, shape[-1])[torch.randperm(shape[-1], generator=g)]
    mix = torch.linalg.qr(torch.randn(shape[-1], shape[-1], generator=g))[0]
    return (torch.randn(shape, generator=g) * spread) @ mix + torch.randn(shape[-1], generator=g)


def stored(seed: int = 0) -> dict[str, torch.Tensor]:
    """A file's matrices as a build writes them: 8-bit bases (the build's eigenvectors on
    their grid), the sketch's projections in fp16, and a tensor left alone."""
    x = keys(seed)
    centred = x - x.mean(dim=2, keepdim=True)
    _, vecs = torch.linalg.eigh(centred.transpose(-1, -2) @ centred)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(2, 3, 64, 64, generator=g) * torch.logspace(0, -1, 64)
    sketch = sketch_basis(x, q.transpose(-1, -2) @ q, 32)
    files = {
        "k_basis": narrowed(vecs.flip(-1)).to(STORE_DTYPE),
        "v_basis": narrowed(vecs).to(STORE_DTYPE),
        "sketch_proj": sketch.query_proj.to(STORE_DTYPE),
        "sketch_key": sketch.key_proj.to(STORE_DTYPE),
        "other": torch.arange(5.0),
    }
    return narrow(files)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    bits = lambda t: t.contiguous().view(torch.uint8) if t.is_floating_point() else t  # noqa: E731
    return set(a) == set(b) and all(
        a[n].dtype == b[n].dtype and torch.equal(bits(a[n]), bits(b[n])) for n in a
    )


def test_the_matrices_come_back_bit_for_bit_and_pack_smaller():
    files = stored()
    coded = constrain(files)
    assert {"k_basis", "v_basis", "sketch_key"}.isdisjoint(coded) and "sketch_proj" in coded
    assert coded["k_basis" + FREE].shape == (2, 3, 64 * 65 // 2)  # column j: 64 - j entries
    assert coded["sketch_key" + FREE].shape == (2, 3, 32, 32)  # B: D - R rows free
    back = dict(coded)
    unconstrain(back)
    assert same(back, files)
    # what the equations fit is the stored number within a step or two
    for name in ("k_basis", "v_basis"):
        residual = coded[name + FIT].long()  # folded: 0, -1, 1, -2, ... as 0, 1, 2, 3, ...
        assert coded[name + FIT].dtype == torch.uint8 and residual.float().mean() < 2
    assert (coded["sketch_key" + FIT].long() <= 8).float().mean() > 0.7  # within 4 fp16 steps
    before, after = (len(pack(t)["packed"]) for t in (files, coded))
    assert after < 0.8 * before


def test_degenerate_matrices_round_trip():
    eye = torch.eye(16).expand(2, 3, 16, 16).to(STORE_DTYPE)
    zeros = torch.zeros(2, 3, 16, 16, dtype=STORE_DTYPE)
    lone = zeros.clone()
    lone[..., 0, 5] = 1.0  # one column, the rest zero
    pca = torch.linalg.qr(torch.randn(2, 3, 16, 8))[0].to(STORE_DTYPE)  # A = B: centred PCA
    square = torch.linalg.qr(torch.randn(2, 3, 16, 16))[0].to(STORE_DTYPE)  # R = D: B all fitted
    for files in (
        narrow({"k_basis": eye, "v_basis": zeros, "sketch_proj": pca, "sketch_key": pca}),
        narrow({"k_basis": lone, "sketch_proj": zeros[..., :8], "sketch_key": pca}),
        narrow({"v_basis": eye[..., :1, :1], "sketch_proj": pca[..., :1, :1] * 0 + 3}),
        {"sketch_proj": square, "sketch_key": square},
    ):
        back = constrain(files)
        unconstrain(back)
        assert same(back, files)


def test_other_forms_are_left_alone():
    fp16 = {"k_basis": torch.eye(8, dtype=STORE_DTYPE)[None], "sketch_key": torch.ones(8, 4)}
    assert constrain(fp16).keys() == fp16.keys()  # no 8-bit codes; no A beside B
    unconstrain(plain := dict(fp16))
    assert same(plain, fp16)


def bump(t: torch.Tensor, at: int) -> None:
    t.view(-1)[at] += 2


@pytest.mark.parametrize(
    "damage",
    [
        lambda t: bump(t["k_basis" + FIT], 7),
        lambda t: bump(t["sketch_key" + FIT], 0),
        lambda t: t["sketch_key" + FREE].view(-1).__setitem__(3, 0.5),
        lambda t: t["sketch_proj"].view(-1).__setitem__(3, 0.5),
        lambda t: t.__setitem__(CHECK, t[CHECK] + 1),
        lambda t: t.pop(CHECK),
        lambda t: t.pop("k_basis" + FREE),
        lambda t: t.pop("v_basis" + EXP),
        lambda t: t.__setitem__("v_basis" + FIT, t["v_basis" + FIT][..., :-1]),
        lambda t: t.__setitem__("v_basis" + FIT, t["v_basis" + FIT].to(torch.float32)),
        lambda t: t.__setitem__("sketch_key" + FIT, t["sketch_key" + FIT][:1]),
        lambda t: t.__setitem__("k_basis" + FREE, t["k_basis" + FREE].to(torch.int16)),
    ],
)
def test_damaged_pieces_are_refused(damage):
    coded = constrain(stored(1))
    damage(coded)
    with pytest.raises(ValueError):
        unconstrain(coded)


@pytest.mark.parametrize("name", ["k_basis", "v_basis", "sketch_key"])
def test_a_prediction_a_step_off_is_caught_by_the_checksum(name):
    """The last fitted number decoded one step away (as another machine's arithmetic might
    round it) stays in range, so only the checksum can tell."""
    coded = constrain(stored(2))
    bump(coded[name + FIT], -1)
    with pytest.raises(ValueError, match="do not decode to the ones stored"):
        unconstrain(coded)
