"""The offload tier on disk is entropy-coded and loads bit for bit (:mod:`sekv_core.rans`):
real codes fitted to rows, real store files, the native coder."""

import hashlib
import json
import lzma

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_store import prepare

import sekv_core.rans as rans
from sekv_core.codec import fit_code, store_codebooks
from sekv_core.config import StoreSettings
from sekv_core.format import manifest_digest, nbytes
from sekv_core.ingest import open_or_build
from sekv_core.packed import compress, decompress
from sekv_core.store import StoreInvalid, load_store

pytestmark = pytest.mark.skipif(not rans.usable(), reason="needs the native library (a C compiler)")


def coded_parts(code, rows_per_part, seed=0):
    """Flat records of parts of rows drawn as the code's were, and the part bounds."""
    g = torch.Generator().manual_seed(seed)
    L, H, D = code.basis.shape[0], code.basis.shape[1], code.basis.shape[-1]
    flat = []
    for n in rows_per_part:
        rows = torch.randn(L, H, n, D, generator=g) * torch.linspace(3, 0.1, D)
        flat.append(code.encode(rows).flatten())
    bounds = torch.tensor([0, *torch.tensor(rows_per_part).cumsum(0).tolist()])
    return torch.cat(flat), bounds


@pytest.mark.parametrize("spec", ["alloc:5", "alloc:3", "*x4", "8x8,24x4,32x2", "4x16,60x4"])
def test_every_code_round_trips_exactly_over_parts_and_is_smaller(spec):
    g = torch.Generator().manual_seed(1)
    fit_rows = torch.randn(2, 3, 300, 64, generator=g) * torch.linspace(3, 0.1, 64)
    code = fit_code(fit_rows, spec, moment=None)
    flat, bounds = coded_parts(code, [1500, 0, 700, 1])
    kinds = {"k_rows": flat, "v_rows": flat.clone()}
    stored = rans.compacted(kinds, bounds, {"k": code, "v": code})
    assert "k_rows" not in stored and "v_rows" not in stored  # coded: it paid
    assert nbytes(stored) < 0.95 * 2 * flat.numel()
    back = rans.expanded(stored, bounds, {"k": code, "v": code})
    assert torch.equal(back["k_rows"], flat) and torch.equal(back["v_rows"], flat)


def test_records_that_do_not_compress_are_kept_as_they_are():
    code = fit_code(torch.randn(1, 2, 50, 64), "*x4")
    noise = torch.randint(0, 256, (1 * 2 * 400 * code.record_bytes,), dtype=torch.uint8)
    bounds = torch.tensor([0, 400])
    stored = rans.compacted({"k_rows": noise, "v_rows": noise}, bounds, {"k": code, "v": code})
    assert set(stored) == {"k_rows", "v_rows"} and stored["k_rows"] is noise  # never larger


def test_a_coding_with_other_tables_or_bytes_is_refused():
    code = fit_code(torch.randn(1, 2, 200, 64) * torch.linspace(3, 0.1, 64), "alloc:5")
    flat, bounds = coded_parts(code, [2000])
    stored = rans.compacted({"k_rows": flat, "v_rows": flat}, bounds, {"k": code, "v": code})
    codes = {"k": code, "v": code}
    params = dict(stored, k_params=scaled(stored["k_params"], 1.01))
    with pytest.raises(ValueError, match="tables differ"):
        rans.expanded(params, bounds, codes)
    for damaged in (stored["k_params"][:-2], compress(torch.zeros(3, dtype=torch.float16))):
        with pytest.raises(ValueError, match="packed tensor"):  # cut short, or too few numbers
            rans.expanded(dict(stored, k_params=damaged), bounds, codes)
    short = dict(stored, k_coded=stored["k_coded"][:-3])
    short["k_coded_bytes"] = stored["k_coded_bytes"] - 3
    with pytest.raises(ValueError, match="does not decode"):
        rans.expanded(short, bounds, codes)
    with pytest.raises(ValueError, match="match its parts"):
        rans.expanded(stored, torch.tensor([0, 1000, 2000]), codes)


def test_a_store_is_coded_on_disk_and_loads_the_records_it_built(tiny_loaded, tmp_path):
    document, context = prepare(tiny_loaded, tmp_path)
    store, _ = open_or_build(tiny_loaded, document, context)
    on_disk = load_file(store.path / "offload.safetensors")
    assert "k_coded" in on_disk and "k_rows" not in on_disk
    b = store.manifest["bytes"]
    assert b["offloaded"] == (store.path / "offload.safetensors").stat().st_size
    assert b["offload_records"] == nbytes(store.offload)
    assert b["offloaded"] < 0.9 * b["offload_records"]
    # the records are the code's of the build's rows: re-coding what was decoded gives them back
    again = rans.compacted(store.offload, store.resident["part_rows"], codes_of(store))
    assert torch.equal(again["k_coded"], on_disk["k_coded"])
    assert torch.equal(again["v_coded"], on_disk["v_coded"])


def scaled(packed: torch.Tensor, factor: float) -> torch.Tensor:
    """A coding's stored table numbers (LZMA-packed fp16) times ``factor``, packed again."""
    params = decompress(packed, torch.float16, len(lzma.decompress(packed.numpy().tobytes())) // 2)
    return compress(params * factor)


def codes_of(store):
    s = store.manifest["settings"]
    return store_codebooks(store.resident, s["key_code"], s["value_code"])


def test_a_forged_coding_is_never_used(tiny_loaded, tmp_path):
    """A coded tier whose tables were changed and whose checksums were recomputed (as a forger
    would) does not load: the tables' own checksum refuses it."""
    document, context = prepare(tiny_loaded, tmp_path)
    store, _ = open_or_build(tiny_loaded, document, context)
    path = store.path / "offload.safetensors"
    tensors = load_file(path)
    tensors["v_params"] = scaled(tensors["v_params"], 0.97)
    save_file(tensors, str(path))
    manifest = json.loads((store.path / "manifest.json").read_text())
    manifest["files"]["offload.safetensors"] = {
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "bytes": path.stat().st_size,
    }
    manifest["bytes"]["offloaded"] = path.stat().st_size
    manifest["bytes"]["store"] = sum(f["bytes"] for f in manifest["files"].values())
    manifest.pop("digest")
    manifest["digest"] = manifest_digest(manifest)
    (store.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreInvalid, match="tables differ"):
        load_store(store.path, tiny_loaded, document, context, StoreSettings())
