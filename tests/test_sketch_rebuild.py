"""The store keeps no routing-sketch rows: they are rebuilt at load from the offload tier's keys,
and the stored fixes make them exactly the rows the build made from the exact keys
(:mod:`sekv_core.sketch_rebuild`)."""

import pytest
import torch
from safetensors.torch import load_file
from test_store import prepare

import sekv_core.build as build_module
from sekv_core.format import nbytes, tier_bytes
from sekv_core.ingest import open_or_build
from sekv_core.packed import unpack
from sekv_core.sketch_rebuild import (
    FIX_GAP,
    apply_fixes,
    fix_tensors,
    packed_fixes,
    unpacked_fixes,
)


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
    # as the store keeps them: compressed bytes that unpack to the same list, or are refused
    packed = packed_fixes(fixes)
    assert packed.dtype == torch.uint8 and torch.equal(unpacked_fixes(packed), fixes)
    assert torch.equal(unpacked_fixes(packed_fixes(fixes[:0])), fixes[:0])
    with pytest.raises(ValueError, match="do not unpack"):
        unpacked_fixes(packed[:-4])


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
