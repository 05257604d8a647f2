"""The sinks' rows recomputed at load (:mod:`sekv_core.sinks`): not in the file, the exact
keys and values of the context's first tokens within the 8-bit rows' rounding, the same at
every load, and a marker that does not fit the store refused."""

import pytest
import torch
from safetensors.torch import load_file
from test_store import prepare

from sekv_core.config import StoreSettings
from sekv_core.format import FIXED_SCALES
from sekv_core.ingest import open_or_build
from sekv_core.kvquant import dequantize_rows
from sekv_core.packed import unpack
from sekv_core.prefill import prefill
from sekv_core.sinks import RECOMPUTED, restore_sinks, sink_rows
from sekv_core.store import StoreInvalid, load_store


def test_a_store_keeps_no_sinks_rows_and_a_load_recomputes_them(tiny_loaded, tmp_path):
    document, context = prepare(tiny_loaded, tmp_path)
    store, _ = open_or_build(tiny_loaded, document, context)
    sinks = store.manifest["positions"]["sinks"]
    on_disk = load_file(store.path / "resident.safetensors")
    unpack(on_disk)
    assert int(on_disk[RECOMPUTED]) == sinks > 0
    held = store.resident
    fixed = held["fixed_pos"].numel()
    assert on_disk["fixed_k"].shape[2] == fixed - sinks  # the anchors' rows only
    assert held["fixed_k"].shape[2] == fixed
    # the loaded rows: the first tokens' exact keys and values, within the rows' rounding
    pre = prefill(tiny_loaded.model, context.ids)
    for (name, scale), exact in zip(FIXED_SCALES.items(), (pre.keys, pre.values), strict=True):
        rows = dequantize_rows(held[name][:, :, :sinks], held[scale][:, :, :sinks], torch.float32)
        step = held[scale][:, :, :sinks].float()[..., None]
        assert bool(((rows - exact[:, :, :sinks]).abs() <= 0.5 * step + 1e-3).all()), name
        assert torch.equal(held[name][:, :, sinks:], on_disk[name])  # the anchors as stored
    # every load: the same rows, bit for bit
    again = load_store(store.path, tiny_loaded, document, context, StoreSettings())
    for name in (*FIXED_SCALES, *FIXED_SCALES.values()):
        assert torch.equal(again.resident[name], held[name]), name


def test_a_marker_that_does_not_fit_is_refused(tiny_loaded, tmp_path):
    document, context = prepare(tiny_loaded, tmp_path)
    store, _ = open_or_build(tiny_loaded, document, context)
    ids = context.ids
    anchors = {n: store.resident[n][:, :, 5:] for n in (*FIXED_SCALES, *FIXED_SCALES.values())}
    for marker in ([0], [len(ids) + 1], [2, 3]):
        resident = {**anchors, RECOMPUTED: torch.tensor(marker)}
        with pytest.raises(ValueError, match="count"):
            restore_sinks(resident, tiny_loaded.model, ids)
    other = {**anchors, RECOMPUTED: torch.tensor([5])}
    other["fixed_k"] = other["fixed_k"][..., :4]  # rows of another model's heads
    with pytest.raises(ValueError, match="fit"):
        restore_sinks(other, tiny_loaded.model, ids)
    rows = sink_rows(tiny_loaded.model, ids[:5])
    assert rows["fixed_k"].shape[2] == 5 and rows["fixed_k"].dtype == torch.int8


def test_a_store_whose_sinks_cannot_be_recomputed_is_not_used(tiny_loaded, tmp_path, monkeypatch):
    import sekv_core.store as store_module

    document, context = prepare(tiny_loaded, tmp_path)
    store, _ = open_or_build(tiny_loaded, document, context)

    def broken(resident, model, ids):
        raise ValueError("the recomputed sinks' count does not fit the context")

    monkeypatch.setattr(store_module, "restore_sinks", broken)
    with pytest.raises(StoreInvalid, match="sinks"):
        load_store(store.path, tiny_loaded, document, context, StoreSettings())
