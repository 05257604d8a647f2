"""The store keeps no routing-sketch rows: they are rebuilt at load from the offload tier's keys,
and the stored fixes make them exactly the rows the build made from the exact keys
(:mod:`sekv_core.sketch_rebuild`)."""

import pytest
import torch
from safetensors.torch import load_file
from test_store import prepare

import sekv_core.build as build_module
from sekv_core.constrained import unconstrain
from sekv_core.format import nbytes, tier_bytes
from sekv_core.ingest import open_or_build
from sekv_core.packed import unpack
from sekv_core.sketch_fixes import FIX_GAP, apply_fixes, decode_fixes, encode_fixes, fix_tensors


def assert_same_sketch(built: torch.Tensor, loaded: torch.Tensor) -> None:
    assert built.dtype == loaded.dtype and built.shape == loaded.shape
    assert torch.equal(built.cpu(), loaded.cpu())


def test_loaded_sketch_is_the_built_one_and_not_on_disk(tiny_loaded, tmp_path, monkeypatch):
    made = {}
    quantize = build_module.quantize_sketch

    def keep(sketch, bits=4):
        made.update(quantize(sketch, bits))
        return made

    monkeypatch.setattr(build_module, "quantize_sketch", keep)
    document_, context = prepare(tiny_loaded, tmp_path)
    store, _ = open_or_build(tiny_loaded, document_, context)
    assert_same_sketch(made["sketch"], store.resident["sketch"])
    on_disk = load_file(store.path / "resident.safetensors")
    unpack(on_disk)
    unconstrain(on_disk)
    assert "sketch" not in on_disk and "sketch_key" in on_disk
    assert 0 < nbytes({"f": on_disk["sketch_fixes"]}) < nbytes({"sketch": made["sketch"]})
    # the manifest counts the sketch where answers hold it: in the resident tier
    assert store.manifest["bytes"]["resident"] == tier_bytes(store.resident)["resident"]
    assert store.manifest["bytes"]["resident"] > tier_bytes(on_disk)["resident"]


def test_fixes_round_trip_across_long_steps():
    delta = torch.zeros(3 * FIX_GAP + 10)
    at = [0, 7, FIX_GAP + 9, FIX_GAP + 10, 3 * FIX_GAP + 9]
    delta[at] = torch.tensor([1.0, -2, 1, 3, -1])
    fixes = fix_tensors(delta)["sketch_fixes"]
    assert fixes.dtype == torch.uint16
    assert len(fixes) == 1 + 2 + (2 + 1) + 3 + (2 + 1)  # |d| each, a +1/-1 pair per long step
    levels = torch.zeros_like(delta)
    apply_fixes(levels, fixes)
    assert torch.equal(levels, delta)
    with pytest.raises(ValueError, match="beyond"):
        apply_fixes(torch.zeros(10), fixes)


def test_ranked_fixes_turn_the_rebuilt_numbers_into_the_built_levels_in_few_bytes():
    """Fixes across the near boundary are ranked by nearness; the rest (two levels, the far
    side, clamped ends) listed flat; both decode to the built levels exactly."""
    g = torch.Generator().manual_seed(0)
    exact = torch.randn(3, 2, 4000, 16, generator=g) * 3  # (L, H, S, R) in levels
    raw = exact + torch.randn(exact.shape, generator=g) * 0.03  # a key code's small error
    built = exact.round().clamp(-7, 7)
    raw.view(-1)[:5] += torch.tensor([2.0, -1.2, 0.7, -0.6, 9.0])  # the rest's kinds of moves
    packed = encode_fixes(raw, built, 7)
    assert packed.dtype == torch.uint8
    assert torch.equal(decode_fixes(raw, packed, 7), built)
    moved = int((raw.round().clamp(-7, 7) != built).sum())
    assert moved > 1000 and packed.numel() < 0.6 * moved  # under 5 bits a fix (flat: ~10)
    empty = encode_fixes(built, built, 7)  # nothing to fix
    assert torch.equal(decode_fixes(built, empty, 7), built)
    with pytest.raises(ValueError, match="do not unpack"):
        decode_fixes(raw, packed[:-4], 7)
    with pytest.raises(ValueError, match="beyond"):
        decode_fixes(raw[:1, :1, :10], packed, 7)


def test_a_store_whose_fixes_would_outweigh_its_rows_keeps_the_rows(
    tiny_loaded, tmp_path, monkeypatch
):
    monkeypatch.setattr(build_module, "sketch_fixes", lambda *args: {})  # (as sketch_fixes says)
    document_, context = prepare(tiny_loaded, tmp_path)
    store, _ = open_or_build(tiny_loaded, document_, context)
    on_disk = load_file(store.path / "resident.safetensors")
    unpack(on_disk)
    assert "sketch_fixes" not in on_disk
    assert_same_sketch(on_disk["sketch"], store.resident["sketch"])
