import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import sekv_core.store.write as write_module
from sekv_core.config import StoreSettings, StreamSettings
from sekv_core.documents import load_document
from sekv_core.ingest import open_or_build
from sekv_core.kvquant import quantize_rows
from sekv_core.models import load_model
from sekv_core.prompt import chat_template, encode_context
from sekv_core.rope import Rope
from sekv_core.sketch import dequantize_sketch, quantize_sketch
from sekv_core.store.format import FILES, FORMAT_VERSION, StoreSource
from sekv_core.store.load import StoreInvalid, load_store
from sekv_core.zoom.memory import SpanMemory

SAMPLES = Path(__file__).resolve().parent.parent / "sample_docs"
TEXT = "\n\n".join(
    f"Section {i}. The {w} vault on floor {i % 9} holds crate {i * 37 % 101} of copper."
    for i, w in enumerate(["north", "south", "old", "new", "red", "blue"] * 6)
)
# what docs/store-format.md says each file holds (a coded kind: ``{k,v}_coded`` etc.)
RESIDENT = {
    "fixed_pos": torch.int64,
    "fixed_k": torch.int8,
    "fixed_k_scale": torch.float16,
    "fixed_v": torch.int8,
    "fixed_v_scale": torch.float16,
    "span_starts": torch.int64,
    "span_ends": torch.int64,
    "span_reps": torch.int64,
    "sketch_proj": torch.float16,
    "sketch_key": torch.float16,
    "sketch_mean": torch.float16,
    "sketch_scale": torch.float16,
    "k_basis": torch.int8,
    "k_basis_exp": torch.int8,
    "k_metric": torch.float16,
    "k_mean": torch.float16,
    "k_range": torch.float16,
    "k_bits": torch.uint8,
    "v_basis": torch.int8,
    "v_basis_exp": torch.int8,
    "v_mean": torch.float16,
    "v_range": torch.float16,
}
OFFLOAD = {
    f"{kind}_{name}": dtype
    for kind in "kv"
    for name, dtype in (
        ("coded", torch.uint8),
        ("block_bytes", torch.int64),
        ("params", torch.float16),
        ("check", torch.uint8),
    )
}
TRACE = {
    "token_ids": torch.int64,
    "surprisal": torch.float32,
    "roles": torch.int8,
    "pages": torch.int32,
    "offsets": torch.int32,
}


def prepare(loaded, tmp_path, text=TEXT):
    doc_path = tmp_path / "doc.md"
    doc_path.write_text(text)
    document = load_document(doc_path)
    context = encode_context(loaded.tokenizer, chat_template(loaded.tokenizer), document.text)
    return document, context


def dtypes(path):
    return {name: t.dtype for name, t in load_file(path).items()}


def test_round_trip_and_cache_hit(tiny_loaded, tmp_path, sekv_home):
    document, context = prepare(tiny_loaded, tmp_path)
    store, hit = open_or_build(tiny_loaded, document, context)
    assert not hit and store.path.parent == sekv_home / "stores"
    again, hit = open_or_build(tiny_loaded, document, context)
    assert hit and again.path == store.path
    m = store.manifest
    # the files hold what the format page says, nothing else
    assert dtypes(store.path / "resident.safetensors") == RESIDENT
    assert dtypes(store.path / "offload.safetensors") == OFFLOAD
    assert dtypes(store.path / "trace.safetensors") == TRACE
    on_disk = load_file(store.path / "resident.safetensors")
    for name, tensor in on_disk.items():
        if name not in ("sketch_proj", "sketch_scale", "sketch_mean"):  # (placed at answer dtype)
            held = again.resident.tensors()[name]
            assert torch.equal(held.cpu().to(tensor.dtype), tensor), name
    assert m["model"]["fingerprint"] == tiny_loaded.fingerprint
    assert m["document"]["sha256"] == document.sha256
    assert set(m["files"]) == set(FILES)
    assert m["bytes"]["resident"] < m["bytes"]["full_kv_fp16"]
    # offload tier: the fixed-rate records decoded from the file, sliced per zoom
    flat = store.tier.whole()["k_rows"]
    assert flat.dtype == torch.uint8
    assert m["bytes"]["offload_records"] == sum(t.numel() for t in store.tier.whole().values())
    assert m["bytes"]["offloaded"] < m["bytes"]["offload_records"]  # entropy-coded on disk
    # the manifest's sizes are the files'
    sizes = {name: (store.path / name).stat().st_size for name in FILES}
    assert m["bytes"]["offloaded"] == sizes["offload.safetensors"]
    assert m["bytes"]["index"] == sizes["resident.safetensors"]
    assert m["bytes"]["store"] == sum(sizes.values())
    # every token role partition is stored and consistent with the span table
    roles = store.trace["roles"]
    assert len(roles) == len(context)
    assert int((roles == 2).sum()) == int(
        (store.resident.span_ends - store.resident.span_starts).sum()
    )


@pytest.mark.parametrize("streamed", [False, True])
def test_a_fresh_build_answers_from_what_a_load_reads_back(tiny_loaded, tmp_path, streamed):
    """A build's session opens the store as any later load does: it holds the same in host
    memory (the keys: a store within the window routes with a sketch of them; no value record
    until an answer reads it), and every table, record and manifest value is the same."""
    document, context = prepare(tiny_loaded, tmp_path)
    settings = replace(StoreSettings(), stream=StreamSettings(always=streamed))
    built, hit = open_or_build(tiny_loaded, document, context, settings)
    loaded, hit_again = open_or_build(tiny_loaded, document, context, settings)
    assert (hit, hit_again) == (False, True)
    keys = built.tier.buffers["k_rows"].numel()
    assert keys > 0 and built.tier.decoded_bytes == loaded.tier.decoded_bytes == keys
    assert built.manifest == loaded.manifest
    for tier in ("resident", "trace", "tier"):
        mine, theirs = getattr(built, tier), getattr(loaded, tier)
        if tier != "trace":
            mine, theirs = (
                t.tensors() if tier == "resident" else t.whole() for t in (mine, theirs)
            )
        assert set(mine) == set(theirs), tier
        for name, t in mine.items():
            other = theirs[name]
            assert t.dtype == other.dtype and t.device == other.device, name
            assert torch.equal(t, other), (tier, name)


def test_streamed_and_one_shot_stores_share_one_format(tiny_model_dirs, tmp_path):
    """A store built by streaming holds the same files, tensor names and dtypes as one built
    in one prefill (a book is the same format as a short document)."""
    loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu")
    document, context = prepare(loaded, tmp_path)
    one_shot, _ = open_or_build(loaded, document, context)
    streamed_settings = replace(StoreSettings(), stream=StreamSettings(always=True))
    streamed, _ = open_or_build(loaded, document, context, streamed_settings)
    assert streamed.path != one_shot.path
    for name in FILES:
        assert dtypes(streamed.path / name) == dtypes(one_shot.path / name), name
    assert streamed.manifest["version"] == one_shot.manifest["version"] == FORMAT_VERSION


def test_the_sketch_is_rebuilt_from_the_decoded_keys(tiny_loaded, tmp_path):
    """The file keeps no sketch rows: a load projects the decoded keys. The rows land within
    a level of the sketch of the exact keys, and every load rebuilds the same rows."""
    document, context = prepare(tiny_loaded, tmp_path)
    store, _ = open_or_build(tiny_loaded, document, context)
    assert "sketch" not in load_file(store.path / "resident.safetensors")
    again = load_store(store.path, StoreSource(tiny_loaded, document, context, StoreSettings()))
    assert torch.equal(store.resident.sketch, again.resident.sketch)
    from sekv_core.prefill import prefill

    pre = prefill(tiny_loaded.model, context.ids, 512)
    r = store.resident
    rows = torch.cat([torch.arange(a, b) for a, b in zip(r.span_starts, r.span_ends, strict=True)])
    keys = pre.keys.float()[:, :, rows]
    exact = (keys - r.sketch_mean.float()[:, :, None]) @ r.sketch_key.float()
    levels = quantize_sketch(exact, 4)["sketch"]  # (at the build's own scale, as stored)
    scale = r.sketch_scale.float()[:, :, None]
    exact = (exact / scale).round().clamp(-7, 7)
    rebuilt = dequantize_sketch(store.resident.sketch.cpu(), exact.shape[-1], torch.float32)
    assert levels.shape == store.resident.sketch.shape
    off = (rebuilt - exact).abs()
    assert float(off.max()) <= 1 and float((off > 0).float().mean()) < 0.25


@pytest.mark.parametrize(
    "target", ["offload.safetensors", "resident.safetensors", "trace.safetensors", "manifest.json"]
)
def test_flipped_byte_is_detected_and_rebuilt(tiny_model_dirs, tmp_path, target):
    loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu")
    document, context = prepare(loaded, tmp_path)
    store, _ = open_or_build(loaded, document, context)
    path = store.path / target
    data = bytearray(path.read_bytes())
    middle = len(data) // 2 if target != "manifest.json" else data.index(b'"sha256"') + 12
    data[middle] ^= 0x01
    path.write_bytes(bytes(data))
    warnings = []
    rebuilt, hit = open_or_build(loaded, document, context, warn=warnings.append)
    assert not hit and len(warnings) == 1, warnings
    assert "rebuilding" in warnings[0]
    # the rebuilt store verifies
    load_store(rebuilt.path, StoreSource(loaded, document, context, StoreSettings()))


def test_store_of_another_model_is_not_used(tiny_model_dirs, tmp_path):
    llama = load_model(str(tiny_model_dirs["llama"]), device="cpu")
    qwen = load_model(str(tiny_model_dirs["qwen2"]), device="cpu")
    document, context = prepare(llama, tmp_path)
    store, _ = open_or_build(llama, document, context)
    with pytest.raises(StoreInvalid, match="fingerprint"):
        load_store(store.path, StoreSource(qwen, document, context, StoreSettings()))
    # and the other model gets a store of its own
    other, hit = open_or_build(qwen, document, context)
    assert not hit and other.path != store.path


def test_interrupted_write_cleans_up(tiny_loaded, tmp_path, sekv_home, monkeypatch):
    fmt = write_module
    document, context = prepare(tiny_loaded, tmp_path)
    real, calls = fmt.save_file, []

    def flaky(tensors, path):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(tensors, path)

    monkeypatch.setattr(fmt, "save_file", flaky)
    with pytest.raises(KeyboardInterrupt):
        open_or_build(tiny_loaded, document, context)
    assert list((sekv_home / "stores").iterdir()) == []


def test_unwritable_home_is_an_actionable_error(tiny_loaded, tmp_path, monkeypatch):
    from sekv_core.errors import SekvError

    home = tmp_path / "home-file"
    home.write_text("not a directory")  # $SEKV_HOME/stores cannot be created under a file
    document, context = prepare(tiny_loaded, tmp_path)
    monkeypatch.setenv("SEKV_HOME", str(home))
    with pytest.raises(SekvError, match="set SEKV_HOME to a writable directory"):
        open_or_build(tiny_loaded, document, context)


def test_the_manifest_counts_the_device_tier_as_answers_hold_it(tiny_loaded, tmp_path):
    """``bytes.resident`` (what ingest and inspect report) is the resident tier an answer
    places on the device, byte for byte."""
    document, context = prepare(tiny_loaded, tmp_path)
    store, _ = open_or_build(tiny_loaded, document, context)
    memory = SpanMemory(store, Rope(tiny_loaded.model), tiny_loaded.device, tiny_loaded.dtype)
    assert store.manifest["bytes"]["resident"] == memory.resident_bytes()
    assert store.manifest["bytes"]["resident"] < store.manifest["bytes"]["full_kv_fp16"]


def test_loads_racing_replacements_verify_or_fail_cleanly(tiny_model_dirs, tmp_path):
    """A store replaced (as builders do, under its lock) while it is loaded: each load either
    verifies and reads its offload tier after its files were deleted, or raises StoreInvalid;
    open_or_build, which retries under the lock, always gets the store."""
    import random
    import shutil
    import threading
    import time

    from sekv_core.locks import store_lock

    fmt = write_module

    loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu")
    document, context = prepare(loaded, tmp_path)
    store, _ = open_or_build(loaded, document, context)
    copy, expected = tmp_path / "copy", store.tier.whole()["k_rows"][:64].clone()
    shutil.copytree(store.path, copy)
    stop, replaced = threading.Event(), []

    def replace_until_stopped() -> None:
        pause = random.Random(0)
        while not stop.is_set():
            tmp = store.path.with_name(".tmp-race")
            shutil.copytree(copy, tmp)
            with store_lock(store.path):
                fmt._replace(tmp, store.path)
            replaced.append(1)
            time.sleep(pause.uniform(0, 0.03))  # quiet moments too: some loads see no replace

    thread = threading.Thread(target=replace_until_stopped)
    thread.start()
    outcomes = {"loaded": 0, "invalid": 0}
    try:
        deadline = time.monotonic() + 60
        while sum(outcomes.values()) < 60 or len(replaced) < 20:  # both, however fast each is
            assert time.monotonic() < deadline, (outcomes, len(replaced))
            try:
                source = StoreSource(loaded, document, context, StoreSettings())
                again = load_store(store.path, source)
            except StoreInvalid:
                outcomes["invalid"] += 1
                continue
            outcomes["loaded"] += 1
            assert torch.equal(again.tier.whole()["k_rows"][:64], expected)
        for _ in range(20):
            assert open_or_build(loaded, document, context)[1]
    finally:
        stop.set()
        thread.join()
    # the race happened (how many loads it spoiled depends on the machine's load: not asserted)
    assert len(replaced) >= 20 and sum(outcomes.values()) >= 60, (outcomes, len(replaced))


def test_store_directories_are_private(tiny_model_dirs, tmp_path, sekv_home):
    """stores/ (also one an older sekv made 0755) and each store are 0700, whatever the umask."""
    loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu")
    document, context = prepare(loaded, tmp_path)
    old = os.umask(0o022)
    try:
        (sekv_home / "stores").mkdir(parents=True, mode=0o755)
        store, _ = open_or_build(loaded, document, context)
    finally:
        os.umask(old)
    assert (sekv_home / "stores").stat().st_mode & 0o777 == 0o700
    assert store.path.stat().st_mode & 0o777 == 0o700


def test_sinks_and_anchors_are_stored_as_answers_hold_them(tiny_loaded, tmp_path, monkeypatch):
    """Their K/V are kept as the 8-bit rows an answer quantises them to, so the answer reads
    exactly those rows."""
    seen = []
    quantize = write_module.quantize_rows

    def keep(rows):
        seen.append(rows.clone())
        return quantize(rows)

    monkeypatch.setattr(write_module, "quantize_rows", keep)
    document, context = prepare(tiny_loaded, tmp_path)
    store, _ = open_or_build(tiny_loaded, document, context)
    on_disk = load_file(store.path / "resident.safetensors")
    assert on_disk["fixed_k"].dtype == torch.int8
    memory = SpanMemory(store, Rope(tiny_loaded.model), tiny_loaded.device, tiny_loaded.dtype)
    for rows, full in zip(memory.fixed, seen, strict=True):
        codes, scale = quantize_rows(full.float())
        assert torch.equal(rows.codes.cpu(), codes) and torch.equal(rows.scale.cpu(), scale)


def test_a_document_of_a_few_tokens_is_stored_and_answered(tiny_loaded, tmp_path):
    """A document too short to hold a span (all sinks) builds, loads and zooms nothing."""
    document, context = prepare(tiny_loaded, tmp_path, text="Hi")
    store, _ = open_or_build(tiny_loaded, document, context)
    assert store.resident.span_starts.numel() == 0 and store.tier.whole()["k_rows"].numel() == 0
    again, hit = open_or_build(tiny_loaded, document, context)
    assert hit and again.resident.sketch.shape[2] == 0


@pytest.mark.integration
def test_a_store_on_disk_follows_its_documents_length(default_model, tmp_path):
    """The store's files against the fp16 full KV cache of its context, with the default
    model: a sentence's no larger (its spans would not pay for their codes' and sketch's
    tables: every token resident), a story of 1.2K tokens at most 0.30 of it."""
    sentence = tmp_path / "ferry.md"
    sentence.write_text(
        "The ferry to Holm leaves the quay at seven each morning and tickets are sold at the "
        "kiosk.\n"
    )
    template = chat_template(default_model.tokenizer)
    for path, bound in ((sentence, 1.0), (SAMPLES / "lighthouse.md", 0.30)):
        document = load_document(path)
        context = encode_context(default_model.tokenizer, template, document.text)
        store, _ = open_or_build(default_model, document, context)
        on_disk = sum(f.stat().st_size for f in store.path.iterdir())
        full = store.manifest["bytes"]["full_kv_fp16"]
        assert on_disk <= bound * full, (path.name, len(context), on_disk / full)


def test_a_full_disk_is_one_actionable_error(tiny_loaded, tmp_path, sekv_home, monkeypatch):
    """Too little free space: an Error naming where and how much, and nothing half-written;
    a device that fills up while the files are written says the same."""
    from sekv_core.errors import SekvError

    document, context = prepare(tiny_loaded, tmp_path)
    usage = write_module.shutil.disk_usage
    monkeypatch.setattr(write_module.shutil, "disk_usage", lambda p: usage(p)._replace(free=1000))
    with pytest.raises(SekvError, match=r"needs about .* free under .*SEKV_HOME"):
        open_or_build(tiny_loaded, document, context)
    assert [p for p in (sekv_home / "stores").iterdir() if not p.name.startswith(".")] == []
    monkeypatch.setattr(write_module.shutil, "disk_usage", usage)

    def full(tensors, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(write_module, "save_file", full)
    with pytest.raises(SekvError, match="no space left"):
        open_or_build(tiny_loaded, document, context)
    assert list((sekv_home / "stores").iterdir()) == []
