import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

import sekv_core.build as build_module
import sekv_core.constrained as constrained
from sekv_core.config import StoreSettings
from sekv_core.constrained import FIT, unconstrain
from sekv_core.documents import load_document
from sekv_core.format import FILES, FORMAT_VERSION, nbytes
from sekv_core.ingest import open_or_build
from sekv_core.kvquant import quantize_rows
from sekv_core.models import load_model
from sekv_core.narrow import NARROWED, widen
from sekv_core.packed import BLOB, KEPT, unpack
from sekv_core.prompt import chat_template, encode_context
from sekv_core.rope import Rope
from sekv_core.sinks import RECOMPUTED
from sekv_core.store import load_store
from sekv_core.zoom import SpanMemory

TEXT = "\n\n".join(
    f"Section {i}. The {w} vault on floor {i % 9} holds crate {i * 37 % 101} of copper."
    for i, w in enumerate(["north", "south", "old", "new", "red", "blue"] * 6)
)


def prepare(loaded, tmp_path, text=TEXT):
    doc_path = tmp_path / "doc.md"
    doc_path.write_text(text)
    document = load_document(doc_path)
    context = encode_context(loaded.tokenizer, chat_template(loaded.tokenizer), document.text)
    return document, context


def test_round_trip_and_cache_hit(tiny_loaded, tmp_path, sekv_home):
    document, context = prepare(tiny_loaded, tmp_path)
    store, hit = open_or_build(tiny_loaded, document, context)
    assert not hit and store.path.parent == sekv_home / "stores"
    again, hit = open_or_build(tiny_loaded, document, context)
    assert hit and again.path == store.path
    m = store.manifest
    on_disk = load_file(store.path / "resident.safetensors")
    assert BLOB in on_disk and set(on_disk) - {BLOB} <= set(KEPT) | {
        name for name in on_disk if name.endswith("_packed")
    }  # every tensor in one stream, but the already compressed
    unpack(on_disk)
    coded = {name + FIT for name in (*NARROWED, "sketch_key")}
    assert coded <= set(on_disk) and not set(NARROWED) & set(on_disk)  # by their equations
    unconstrain(on_disk)
    assert {on_disk[name].dtype for name in NARROWED} == {torch.int8}  # directions in 8 bits
    widen(on_disk)  # (what a load reads: the numbers the build used)
    sinks = int(on_disk.pop(RECOMPUTED))  # the sinks' rows: recomputed at load, not stored
    assert sinks == m["positions"]["sinks"] > 0
    for name, tensor in on_disk.items():
        held = again.resident[name]
        if name.startswith("fixed_") and name != "fixed_pos":
            held = held[:, :, sinks:]  # the anchors' rows, as stored
        assert torch.equal(held.to(tensor.dtype).cpu(), tensor), name
    assert m["model"]["fingerprint"] == tiny_loaded.fingerprint
    assert m["document"]["sha256"] == document.sha256
    assert set(m["files"]) == set(FILES)
    assert m["bytes"]["resident"] < m["bytes"]["full_kv_fp16"]
    # offloaded tier: the fixed-rate records (decoded from the file), sliced per zoom
    flat = store.offload["k_rows"]
    assert flat.dtype == torch.uint8
    assert torch.equal(store.offload_slice("k_rows", 5, 50), flat[5:50])
    assert m["bytes"]["offload_records"] == nbytes(store.offload)
    # the manifest's sizes are the files': the offload tier and the whole store
    sizes = {name: (store.path / name).stat().st_size for name in FILES}
    assert m["bytes"]["offloaded"] == sizes["offload.safetensors"]
    assert m["bytes"]["store"] == sum(sizes.values())
    # every token role partition is stored and consistent with the span table
    roles = store.trace["roles"]
    assert len(roles) == len(context)
    assert int((roles == 2).sum()) == int(
        (store.resident["span_ends"] - store.resident["span_starts"]).sum()
    )


@pytest.mark.parametrize("target", ["offload.safetensors", "resident.safetensors", "manifest.json"])
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
    load_store(rebuilt.path, loaded, document, context, StoreSettings())


def test_matrices_decoded_otherwise_are_refused_and_rebuilt(tiny_loaded, tmp_path, monkeypatch):
    """A load whose predictions of the coded matrices differ from the build's (as another
    machine's arithmetic might) does not use the store."""
    document, context = prepare(tiny_loaded, tmp_path)
    open_or_build(tiny_loaded, document, context)
    predict = constrained._Orthogonal.predict

    def off_by_one(self, col):
        out = predict(self, col)
        return out + (self.j == 5)  # one column's predictions a step away

    monkeypatch.setattr(constrained._Orthogonal, "predict", off_by_one)
    warnings = []
    _, hit = open_or_build(tiny_loaded, document, context, warn=warnings.append)
    assert not hit and len(warnings) == 1 and "rebuilding" in warnings[0], warnings
    assert "resident.safetensors" in warnings[0]  # (its checksum, or a code out of range)


def test_store_of_another_model_is_not_used(tiny_model_dirs, tmp_path):
    llama = load_model(str(tiny_model_dirs["llama"]), device="cpu")
    qwen = load_model(str(tiny_model_dirs["qwen2"]), device="cpu")
    document, context = prepare(llama, tmp_path)
    store, _ = open_or_build(llama, document, context)
    from sekv_core.store import StoreInvalid

    with pytest.raises(StoreInvalid, match="fingerprint"):
        load_store(store.path, qwen, document, context, StoreSettings())
    # and the other model gets a store of its own
    other, hit = open_or_build(qwen, document, context)
    assert not hit and other.path != store.path


def test_killed_ingest_leaves_nothing_that_loads(tiny_model_dirs, tmp_path, sekv_home):
    """SIGKILL the process while it writes the store's files: no store directory appears."""
    doc = tmp_path / "doc.md"
    doc.write_text(TEXT)
    script = textwrap.dedent(f"""
        import os, signal
        import sekv_core.format as fmt
        import sekv_core.ingest as ingest
        real = fmt.save_file
        def save_then_die(tensors, path):
            real(tensors, path)
            os.kill(os.getpid(), signal.SIGKILL)  # after the first file, mid-store
        fmt.save_file = save_then_die
        from sekv_core.documents import load_document
        from sekv_core.models import load_model
        from sekv_core.prompt import chat_template, encode_context
        loaded = load_model({str(tiny_model_dirs["llama"])!r}, device="cpu")
        document = load_document({str(doc)!r})
        ctx = encode_context(loaded.tokenizer, chat_template(loaded.tokenizer), document.text)
        ingest.open_or_build(loaded, document, ctx)
    """)
    env = dict(os.environ, SEKV_HOME=str(sekv_home))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    stores = sekv_home / "stores"
    left = list(stores.iterdir())
    assert [p.name[:5] for p in left] == [".tmp-"]  # the dead writer's half-written store
    # a later ingest builds a fresh, valid store
    loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu")
    document = load_document(doc)
    ctx = encode_context(loaded.tokenizer, chat_template(loaded.tokenizer), document.text)
    store, hit = open_or_build(loaded, document, ctx)
    assert (
        not hit
        and json.loads((store.path / "manifest.json").read_text())["version"] == FORMAT_VERSION
    )
    assert not left[0].exists()  # and removed it


def test_interrupted_write_cleans_up(tiny_loaded, tmp_path, sekv_home, monkeypatch):
    import sekv_core.format as fmt

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
    places on the device, byte for byte; the host index is the rest of resident.safetensors."""
    from sekv_core.format import nbytes
    from sekv_core.rope import Rope
    from sekv_core.zoom import SpanMemory

    document, context = prepare(tiny_loaded, tmp_path)
    store, _ = open_or_build(tiny_loaded, document, context)
    memory = SpanMemory(store, Rope(tiny_loaded.model), tiny_loaded.device, tiny_loaded.dtype)
    assert store.bytes["resident"] == memory.resident_bytes()
    stored = load_file(store.path / "resident.safetensors")  # both tiers' tensors, packed
    assert 0 < store.bytes["index"] and nbytes(stored) < sum(
        store.bytes[name] for name in ("index", "resident")
    )
    assert store.bytes["resident"] < store.bytes["full_kv_fp16"]


def test_loads_racing_replacements_verify_or_fail_cleanly(tiny_model_dirs, tmp_path):
    """A store replaced (as builders do, under its lock) while it is loaded: each load either
    verifies and reads its offload tier after its files were deleted, or raises StoreInvalid;
    open_or_build, which retries under the lock, always gets the store."""
    import random
    import shutil
    import threading
    import time

    import sekv_core.format as fmt
    from sekv_core.locks import store_lock
    from sekv_core.store import StoreInvalid

    loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu")
    document, context = prepare(loaded, tmp_path)
    store, _ = open_or_build(loaded, document, context)
    copy, expected = tmp_path / "copy", store.offload_slice("k_rows", 0, 64).clone()
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
                again = load_store(store.path, loaded, document, context, StoreSettings())
            except StoreInvalid:
                outcomes["invalid"] += 1
                continue
            outcomes["loaded"] += 1
            assert torch.equal(again.offload_slice("k_rows", 0, 64), expected)
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
    """Their K/V are kept as the 8-bit rows an answer quantises them to (half the bytes of fp16
    rows on disk), so the answer reads exactly those rows."""
    seen = {}
    quantize = build_module.quantize_fixed

    def keep(resident):
        seen.update(k=resident["fixed_k"].clone(), v=resident["fixed_v"].clone())
        quantize(resident)

    monkeypatch.setattr(build_module, "quantize_fixed", keep)
    document, context = prepare(tiny_loaded, tmp_path)
    store, _ = open_or_build(tiny_loaded, document, context)
    on_disk = load_file(store.path / "resident.safetensors")
    unpack(on_disk)
    assert on_disk["fixed_k"].dtype == torch.int8 and seen["k"].dtype == torch.float16
    memory = SpanMemory(store, Rope(tiny_loaded.model), tiny_loaded.device, tiny_loaded.dtype)
    for rows, fp16 in zip(memory.fixed, (seen["k"], seen["v"]), strict=True):
        codes, scale = quantize_rows(fp16)  # what answers held when the store kept fp16 rows
        assert torch.equal(rows.codes.cpu(), codes) and torch.equal(rows.scale.cpu(), scale)
