"""The offload tier on disk is entropy-coded and loads bit for bit
(:mod:`sekv_core.store.entropy`): real codes fitted to rows, real store files, the native coder."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_store import prepare

import sekv_core.store.entropy as entropy
from sekv_core.config import StoreSettings
from sekv_core.ingest import open_or_build
from sekv_core.rope import Rope
from sekv_core.store.codes import fit_code, store_codebooks
from sekv_core.store.format import StoreSource, manifest_digest, nbytes, sha256
from sekv_core.store.load import StoreInvalid, load_store
from sekv_core.zoom.memory import SpanMemory

needs_native = pytest.mark.skipif(
    not entropy.usable(), reason="needs the native library (a C compiler)"
)


def coded_parts(code, rows_per_part, seed=0) -> list[torch.Tensor]:
    """Records (L, H, n, B) of parts of rows drawn as the code's were."""
    g = torch.Generator().manual_seed(seed)
    L, H, D = code.basis.shape[0], code.basis.shape[1], code.basis.shape[-1]
    out = []
    for n in rows_per_part:
        rows = torch.randn(L, H, n, D, generator=g) * torch.linspace(3, 0.1, D)
        out.append(code.encode(rows))
    return out


def expanded(stored, rows, codes) -> dict[str, torch.Tensor]:
    """Every record of an offload file's tensors, decoded."""
    return entropy.OffloadTier(stored, rows, codes).whole()


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts' records as a build hands them over: (L, H, S, B), a layer's rows in order."""
    return torch.cat(parts, dim=2)


@needs_native
@pytest.mark.parametrize("spec", ["even:0.175", "even:0.05", "even:4", "*x4"])
def test_every_code_round_trips_exactly_and_is_smaller(spec):
    g = torch.Generator().manual_seed(1)
    fit_rows = torch.randn(2, 3, 300, 64, generator=g) * torch.linspace(3, 0.1, 64)
    code = fit_code(fit_rows, spec)
    sizes = [1500, 0, 700, 1]
    parts = coded_parts(code, sizes)
    codes = {"k": code, "v": code}
    records = joined(parts)
    stored = entropy.compacted({"k": records, "v": records.clone()}, codes)
    assert "k_rows" not in stored and "v_rows" not in stored  # coded: it paid
    assert nbytes(stored) < 0.95 * 2 * records.numel()
    back = expanded(stored, sum(sizes), codes)
    assert torch.equal(back["k_rows"], records.flatten())
    assert torch.equal(back["v_rows"], records.flatten())


@needs_native
def test_records_that_do_not_compress_are_kept_as_they_are():
    code = fit_code(torch.randn(1, 2, 50, 64), "*x4")
    noise = torch.randint(0, 256, (1, 2, 400, code.record_bytes), dtype=torch.uint8)
    stored = entropy.compacted({"k": noise, "v": noise}, {"k": code, "v": code})
    assert set(stored) == {"k_rows", "v_rows"}  # never larger than the records
    assert torch.equal(stored["k_rows"], noise.flatten())
    back = expanded(stored, 400, {"k": code, "v": code})
    assert torch.equal(back["v_rows"], noise.flatten())
    with pytest.raises(ValueError, match="not those of its spans"):  # another count of rows
        expanded(stored, 399, {"k": code, "v": code})


@needs_native
def test_a_coding_with_other_tables_or_bytes_is_refused():
    code = fit_code(torch.randn(1, 2, 200, 64) * torch.linspace(3, 0.1, 64), "even:0.175")
    parts = coded_parts(code, [2000])
    codes, rows = {"k": code, "v": code}, 2000
    stored = entropy.compacted({"k": joined(parts), "v": joined(parts)}, codes)
    assert stored["k_params"].dtype == torch.float16 and stored["k_params"].shape[1] == 2
    with pytest.raises(ValueError, match="tables differ"):
        expanded(dict(stored, k_params=stored["k_params"] * 1.01), rows, codes)
    check = stored["k_check"].clone()
    check[0] ^= 1
    with pytest.raises(ValueError, match="tables differ"):
        expanded(dict(stored, k_check=check), rows, codes)
    with pytest.raises(ValueError, match="match its layers"):  # too few numbers
        expanded(dict(stored, k_params=stored["k_params"][:-1]), rows, codes)
    for cut in (1, 2, 3, 7, 8, 9, 16, 100):  # a coding cut short, by odd bytes or whole words
        short = dict(stored, k_coded=stored["k_coded"][:-cut])
        short["k_block_bytes"] = stored["k_block_bytes"].clone()
        short["k_block_bytes"][-1] -= cut
        with pytest.raises(ValueError, match="does not decode|do not add up"):
            expanded(short, rows, codes)
    swapped = stored["k_block_bytes"].clone()  # bytes moved from one block to the next
    swapped[0], swapped[1] = swapped[0] - 2, swapped[1] + 2
    with pytest.raises(ValueError, match="does not decode"):
        expanded(dict(stored, k_block_bytes=swapped), rows, codes)
    longer = dict(stored, k_coded=torch.cat([stored["k_coded"], torch.zeros(2, dtype=torch.uint8)]))
    with pytest.raises(ValueError, match="do not add up"):
        expanded(longer, rows, codes)
    with pytest.raises(ValueError, match="does not decode"):  # another count of rows
        expanded(stored, 1999, codes)


@needs_native
def test_a_read_decodes_the_blocks_that_hold_its_records_and_no_other():
    code = fit_code(torch.randn(2, 3, 200, 64) * torch.linspace(3, 0.1, 64), "even:0.175")
    records = joined(coded_parts(code, [300]))  # (2, 3, 300, B): five blocks per (layer, head)
    codes, B = {"k": code, "v": code}, code.record_bytes
    stored = entropy.compacted({"k": records, "v": records}, codes)
    tier = entropy.OffloadTier(stored, 300, codes)
    assert tier.decoded_bytes == 0 and tier.nbytes == 2 * records.numel()
    # rows 60..69 of (layer 1, head 2) cross a block's end: two blocks of 64 rows per kind
    first = torch.tensor([(1 * 3 + 2) * 300 + 60])
    tier.fill(first, torch.tensor([10]))
    assert tier.decoded_bytes == 2 * 2 * 64 * B
    for kind in ("k", "v"):
        got = tier.buffers[f"{kind}_rows"].view(2, 3, 300, B)
        assert torch.equal(got[1, 2, :128], records[1, 2, :128])
    tier.fill(first + 5, torch.tensor([3]))  # decoded already: nothing more
    assert tier.decoded_bytes == 2 * 2 * 64 * B
    tier.fill(torch.tensor([299, 0]), torch.tensor([1, 0]))  # the short last block; an empty range
    assert tier.decoded_bytes == 2 * (2 * 64 + 44) * B
    tier.fill(torch.tensor([300 + 10]), torch.tensor([150]))  # (layer 0, head 1): three blocks
    assert tier.decoded_bytes == 2 * (2 * 64 + 44 + 3 * 64) * B
    assert torch.equal(tier.buffers["v_rows"].view(2, 3, 300, B)[0, 1, :192], records[0, 1, :192])
    assert torch.equal(tier.whole()["k_rows"], records.flatten())
    assert tier.decoded_bytes == tier.nbytes and not tier._coded  # the codings let go


def codes_of(store):
    s = store.manifest["settings"]
    return store_codebooks(store.resident.codebooks, s["key_code"], s["value_code"])


def records_of(store, codes) -> dict[str, torch.Tensor]:
    """The store's decoded records, (L, H, S, B)."""
    L, H = store.resident.fixed_k.shape[:2]
    out = {}
    for kind in ("k", "v"):
        out[kind] = store.tier.whole()[f"{kind}_rows"].view(L, H, -1, codes[kind].record_bytes)
    return out


@needs_native
def test_a_store_is_coded_on_disk_and_loads_the_records_it_built(tiny_loaded, tmp_path):
    document, context = prepare(tiny_loaded, tmp_path)
    store, _ = open_or_build(tiny_loaded, document, context)
    on_disk = load_file(store.path / "offload.safetensors")
    assert "k_coded" in on_disk and "k_rows" not in on_disk and "v_coded" in on_disk
    b = store.manifest["bytes"]
    assert b["offloaded"] == (store.path / "offload.safetensors").stat().st_size
    assert b["offload_records"] == nbytes(store.tier.whole())
    assert b["offloaded"] < 0.9 * b["offload_records"]
    # the records are the build's: coding what the load decoded gives the file's bytes back
    codes = codes_of(store)
    again = entropy.compacted(records_of(store, codes), codes)
    assert again.keys() == on_disk.keys()
    for name, tensor in on_disk.items():
        assert torch.equal(again[name], tensor), name


@needs_native
def test_a_load_decodes_no_value_and_a_zoom_decodes_the_blocks_it_reads(tiny_loaded, tmp_path):
    """A store within the window decodes its keys at load (its sketch's rows are rebuilt from
    them) and no value; reconstructing one span decodes the value blocks that hold it, and gives
    the rows a whole decode gives."""
    document, context = prepare(tiny_loaded, tmp_path)
    built, _ = open_or_build(tiny_loaded, document, context)
    store = load_store(built.path, StoreSource(tiny_loaded, document, context, StoreSettings()))
    tier = store.tier
    key_bytes = tier.buffers["k_rows"].numel()
    assert tier.decoded_bytes == key_bytes < tier.nbytes
    memory = SpanMemory(store, Rope(tiny_loaded.model), "cpu", torch.float32)
    span, head = torch.tensor([3]), torch.tensor([memory.num_kv_heads - 1])
    layer = memory.num_layers - 1
    k, v = memory.reconstruct(layer, span, head, rotate=False)
    value_bytes = codes_of(store)["v"].record_bytes
    assert key_bytes < tier.decoded_bytes <= key_bytes + 2 * 64 * value_bytes  # one or two blocks
    whole = SpanMemory(built, Rope(tiny_loaded.model), "cpu", torch.float32)
    k2, v2 = whole.reconstruct(layer, span, head, rotate=False)
    assert torch.equal(k, k2) and torch.equal(v, v2)


def forge(store, change) -> None:
    """Change the offload file's tensors and recompute every checksum, as a forger would."""
    path = store.path / "offload.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, str(path))
    manifest = json.loads((store.path / "manifest.json").read_text())
    size = path.stat().st_size
    manifest["files"]["offload.safetensors"] = {"sha256": sha256(path), "bytes": size}
    manifest["bytes"]["offloaded"] = size
    manifest["bytes"]["store"] = sum(f["bytes"] for f in manifest["files"].values())
    manifest.pop("digest")
    manifest["digest"] = manifest_digest(manifest)
    (store.path / "manifest.json").write_text(json.dumps(manifest))


def scale_params(t):
    t["v_params"] = t["v_params"] * 0.97


def flip_check(t):
    t["k_check"][5] ^= 0x10


def cut_coding(t):
    t["k_coded"] = t["k_coded"][:-3].clone()
    t["k_block_bytes"][-1] -= 3


@needs_native
@pytest.mark.parametrize(
    "change, reason",
    [(scale_params, "tables differ"), (flip_check, "tables differ"), (cut_coding, "not decode")],
    ids=["params", "check", "coded"],
)
def test_a_forged_coding_is_never_used(tiny_loaded, tmp_path, change, reason):
    """A coded tier whose tables, checksum or bytes were changed and whose checksums were
    recomputed does not load (the tables' own checksum, or the coder, refuses it): the next
    open rebuilds the store, saying why."""
    document, context = prepare(tiny_loaded, tmp_path)
    store, _ = open_or_build(tiny_loaded, document, context)
    built = (store.path / "offload.safetensors").read_bytes()
    forge(store, change)
    with pytest.raises(StoreInvalid, match=reason):
        load_store(store.path, StoreSource(tiny_loaded, document, context, StoreSettings()))
    warnings = []
    rebuilt, hit = open_or_build(tiny_loaded, document, context, warn=warnings.append)
    assert not hit and len(warnings) == 1 and reason in warnings[0], warnings
    assert (rebuilt.path / "offload.safetensors").read_bytes() == built


def test_without_the_native_coder_a_store_keeps_its_records_and_loads(
    tiny_loaded, tmp_path, monkeypatch
):
    """A machine without the native library writes each kind's records as they are, and loads
    them; a coded store it cannot decode is refused and rebuilt that way."""
    document, context = prepare(tiny_loaded, tmp_path)
    coded = None
    if entropy.usable():
        coded, _ = open_or_build(tiny_loaded, document, context)
        expected = {k: v.clone() for k, v in coded.tier.whole().items()}
    monkeypatch.setattr(entropy, "usable", lambda: False)
    warnings = []
    store, hit = open_or_build(tiny_loaded, document, context, warn=warnings.append)
    assert not hit
    if coded is not None:
        assert len(warnings) == 1 and "native library is missing" in warnings[0], warnings
        for name, tensor in expected.items():
            assert torch.equal(store.tier.whole()[name], tensor), name
    on_disk = load_file(store.path / "offload.safetensors")
    assert set(on_disk) == {"k_rows", "v_rows"}
    assert store.manifest["bytes"]["offload_records"] == nbytes(on_disk)
    again, hit = open_or_build(tiny_loaded, document, context)
    assert hit and torch.equal(again.tier.whole()["k_rows"], on_disk["k_rows"])
