"""An independent reader of a span store, written from docs/store-format.md alone (numpy, torch
and safetensors' loader; nothing of sekv_core.store), checked against what sekv itself loads: the
format page must be complete enough to read a store."""

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import build_tiny_model
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save_file as save_safetensors
from test_store import TEXT
from test_stream import document, text_of

import sekv_core.store.entropy as entropy  # only its switch: a store without the coder
from sekv_core.config import StoreSettings
from sekv_core.ingest import open_or_build
from sekv_core.models import load_model
from sekv_core.prefill import prefill
from sekv_core.prompt import chat_template, encode_context
from sekv_core.rope import Rope
from sekv_core.sketch import dequantize_sketch
from sekv_core.zoom.memory import SpanMemory

FILES = ("resident.safetensors", "offload.safetensors", "trace.safetensors")
CASES = {  # (text, settings, positions.mode), in a 512-token window
    "original": (text_of(9), StoreSettings(), "original"),  # one prefill
    "bounded": (TEXT, StoreSettings(), "bounded"),  # streamed (here: a layer without spare bits)
    "raw-rows": (text_of(9), StoreSettings(), "original"),  # without the native coder
    "zero-bit-keys": (text_of(9), StoreSettings(key_code="even:3"), "original"),
}


class Refused(Exception):
    pass


def digest(manifest: dict) -> str:
    rest = {k: v for k, v in manifest.items() if k != "digest"}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def verified(path, expect: dict) -> tuple[dict, dict]:
    """The manifest and the three files' tensors, checked in the page's order."""
    manifest = json.loads((path / "manifest.json").read_text())
    if manifest.get("format") != "sekv-span-store" or manifest.get("version") != 20:
        raise Refused("version")
    if manifest["digest"] != digest(manifest):
        raise Refused("digest")
    for field, value in expect.items():  # e.g. "document/sha256"
        section, name = field.split("/")
        if manifest[section][name] != value:
            raise Refused(field)
    tensors = {}
    for name in FILES:
        data = (path / name).read_bytes()  # hashed, then parsed: the same bytes
        entry = manifest["files"][name]
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise Refused(name)
        tensors[name.split(".")[0]] = load_safetensors(data)
    return manifest, tensors


def key_fields(bits: np.ndarray, record_bytes: int) -> list[list[int]]:
    """Each layer's key fields (``bits``: (L, D)): every direction's bits (0 too), then as many
    padding fields in every layer as the largest spare needs, each at most 8 wide."""
    spare = 8 * record_bytes - bits.astype(np.int64).sum(-1)
    pads = -(-int(spare.max()) // 8)
    return [
        [int(b) for b in layer] + [min(8, max(0, int(left) - 8 * i)) for i in range(pads)]
        for layer, left in zip(bits, spare, strict=True)
    ]


def table(width: int, centre: float, spread: float) -> np.ndarray:
    """A stream's frequencies (units of 2^-12): a Gaussian over the symbols."""
    n = 1 << width
    p = np.exp(-0.5 * ((np.arange(n) - centre) / spread) ** 2)
    p /= p.sum()
    freq = 1 + np.floor(p * (4096 - n)).astype(np.int64)
    freq[np.argmax(p)] += 4096 - freq.sum()
    return freq


def rans_block(data: bytes, streams: list[np.ndarray], rows: int) -> list[list[int]]:
    """One block's symbols, field after field (four interleaved rANS states, 16-bit words)."""
    state = [int.from_bytes(data[4 * j : 4 * j + 4], "big") for j in range(4)]
    at, out = 16, []
    for freq in streams:
        cum = np.concatenate([[0], np.cumsum(freq)]).tolist()
        symbol_of, f = np.repeat(np.arange(len(freq)), freq).tolist(), freq.tolist()
        column = []
        for r in range(rows):
            x = state[r & 3]
            s = symbol_of[x & 4095]
            x = f[s] * (x >> 12) + (x & 4095) - cum[s]
            if x < 1 << 16:
                x, at = (x << 16) | data[at] | data[at + 1] << 8, at + 2
            state[r & 3] = x
            column.append(s)
        out.append(column)
    if state != [1 << 16] * 4 or at != len(data) - 2:
        raise Refused("coding does not end at its initial states")
    return out


def records(offload: dict, kind: str, fields: list[list[int]], shape: tuple) -> np.ndarray:
    """The (L, H, S, B) records of ``kind``, raw or rANS-decoded; ``fields[layer]``: widths."""
    if f"{kind}_rows" in offload:
        return offload[f"{kind}_rows"].reshape(shape)
    L, H, S, B = shape
    params = offload[f"{kind}_params"].astype(np.float64)
    widths = [w for layer in range(L) for _ in range(H) for w in fields[layer]]
    tables = [table(w, *params[i]) for i, w in enumerate(widths)]
    padded = np.stack([np.pad(t, (0, 256 - len(t))) for t in tables]).astype("<u2")
    if hashlib.sha256(padded.tobytes()).digest() != offload[f"{kind}_check"].tobytes():
        raise Refused("tables")
    out, start = np.zeros(shape, np.uint8), 0
    sizes = iter(offload[f"{kind}_block_bytes"].tolist())
    for layer in range(L):
        F = len(fields[layer])
        for h in range(H):
            streams = tables[(layer * H + h) * F : (layer * H + h + 1) * F]
            for first in range(0, S, 64):  # blocks of 64 rows, each coded alone
                size, rows = next(sizes), min(64, S - first)
                data = offload[f"{kind}_coded"][start : start + size].tobytes() + b"\0\0"
                start += size
                symbols = rans_block(data, streams, rows)
                bits = np.concatenate(
                    [
                        (np.array(col)[:, None] >> np.arange(w)) & 1
                        for col, w in zip(symbols, fields[layer], strict=True)
                    ],
                    1,
                )  # each field's bits, lowest first, field after field
                out[layer, h, first : first + rows] = np.packbits(
                    bits.astype(np.uint8), axis=1, bitorder="little"
                )
    return out


def basis(r: dict, kind: str) -> torch.Tensor:
    return torch.from_numpy(r[f"{kind}_basis"] * 2.0 ** r[f"{kind}_basis_exp"].astype(np.float64))


def decode_keys(rec: np.ndarray, r: dict) -> torch.Tensor:
    """even:S: row = mean + ((code - levels) * step) @ basis^-1 / sqrt(metric)."""
    bits = r["k_bits"].astype(np.int64)  # (L, H, D)
    flat = np.unpackbits(rec, axis=-1, bitorder="little").astype(np.int64)
    codes = np.zeros(rec.shape[:3] + bits.shape[-1:], np.int64)
    for layer in range(bits.shape[0]):
        ends, at = np.cumsum(bits[layer, 0]), 0
        for d, end in enumerate(ends):
            codes[layer, :, :, d] = (flat[layer, :, :, at:end] << np.arange(end - at)).sum(-1)
            at = end
    levels = np.maximum((1 << np.maximum(bits - 1, 0)) - 1, 1)[:, :, None]  # 0-bit: unused
    step = r["k_range"].astype(np.float64)[:, :, None] / levels
    coef = torch.from_numpy(np.where(bits[:, :, None] > 0, (codes - levels) * step, 0.0))
    rows = coef @ torch.linalg.inv(basis(r, "k"))
    metric = torch.from_numpy(r["k_metric"].astype(np.float64))[:, :, None]
    return torch.from_numpy(r["k_mean"].astype(np.float64))[:, :, None] + rows / metric.sqrt()


def decode_values(rec: np.ndarray, r: dict) -> torch.Tensor:
    """*x4: one tier of every direction at 4 bits (stored code + 7), then its F16 scale."""
    D = r["v_mean"].shape[-1]
    pairs = rec[..., : D // 2]
    codes = np.stack([pairs & 15, pairs >> 4], -1).reshape(rec.shape[:3] + (D,))
    scale = rec[..., D // 2 : D // 2 + 2].copy().view("<f2").astype(np.float64)
    coef = (codes.astype(np.float64) - 7) * scale * r["v_range"].astype(np.float64)[:, :, None]
    rows = torch.from_numpy(coef) @ torch.linalg.inv(basis(r, "v"))
    return torch.from_numpy(r["v_mean"].astype(np.float64))[:, :, None] + rows


def rotated(model, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE keys (..., S, D) at ``positions`` with the model's rotary tables (rotate-half)."""
    cos, sin = model.model.rotary_emb(keys.float(), positions[None])
    half = keys.shape[-1] // 2
    turned = torch.cat([-keys[..., half:], keys[..., :half]], -1)
    return keys * cos[0].double() + turned * sin[0].double()


def fixed_rows(r: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The sinks' and anchors' K and V (L, H, F, D): 8-bit codes times their row's scale."""
    return tuple(
        torch.from_numpy(r[name].astype(np.float64) * r[f"{name}_scale"][..., None])
        for name in ("fixed_k", "fixed_v")
    )


SPANLESS = {  # the tensors of a store without span tokens
    "resident": {"fixed_pos", "fixed_k", "fixed_v", "fixed_k_scale", "fixed_v_scale"}
    | {"span_starts", "span_ends", "span_reps"},
    "offload": {"k_rows", "v_rows"},
}


def read(path, expect: dict, model) -> dict:
    """Everything the page says a reader gets from the files alone."""
    manifest, t = verified(path, expect)
    r, offload = t["resident"], t["offload"]
    starts, ends = torch.from_numpy(r["span_starts"]), torch.from_numpy(r["span_ends"])
    S = int((ends - starts).sum())
    if not S:  # no codes, no sketch, no records: every token resident
        if set(r) != SPANLESS["resident"] or set(offload) != SPANLESS["offload"]:
            raise Refused("a store without span tokens holds more")
        if any(offload[name].size for name in offload):
            raise Refused("a store without span tokens holds records")
        return dict(trace=t["trace"], fixed=fixed_rows(r), fixed_pos=r["fixed_pos"])
    L, H, D = r["k_bits"].shape
    widest = int(r["k_bits"].astype(np.int64).sum(-1).max())
    key_b, value_b = -(-widest // 8), D // 2 + 2
    assert manifest["settings"]["value_code"] == "*x4"  # the default tiers
    k_fields = key_fields(r["k_bits"][:, 0], key_b)
    v_fields = [[4] * D + [8, 8]] * L
    rec = {
        "k": records(offload, "k", k_fields, (L, H, S, key_b)),
        "v": records(offload, "v", v_fields, (L, H, S, value_b)),
    }
    keys, values = decode_keys(rec["k"], r), decode_values(rec["v"], r)
    # the sketch rows: keys at their own positions when "original", pre-RoPE when "bounded"
    at = torch.cat([torch.arange(a, b) for a, b in zip(starts, ends, strict=True)])
    original = manifest["positions"]["mode"] == "original"
    k = (rotated(model, keys, at) if original else keys).float()
    mean, key = (torch.from_numpy(r[n]).float() for n in ("sketch_mean", "sketch_key"))
    top = 127 if manifest["settings"]["sketch_bits"] == 8 else 7
    scale = torch.from_numpy(r["sketch_scale"]).float()[:, :, None]
    sketch = (((k - mean[:, :, None]) @ key) / scale).round().clamp(-top, top)
    stored = r.get("sketch")  # a bounded store's rows: 4-bit levels + 8, two a byte, low first
    if stored is not None and top == 7:
        stored = np.stack([stored & 15, stored >> 4], -1).reshape(*stored.shape[:-1], -1) - 8.0
    out = dict(trace=t["trace"], records=rec, keys=keys, values=values, sketch=sketch, at=at)
    return out | {"stored_sketch": stored}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A tiny Llama with a 512-token window (test_store's TEXT is a book to it)."""
    path = build_tiny_model(tmp_path_factory.mktemp("reader") / "llama", "llama", 512)
    return load_model(str(path), device="cpu")


def built(small, tmp_path, case):
    text, settings, mode = CASES[case]
    doc = document(tmp_path, text)
    ctx = encode_context(small.tokenizer, chat_template(small.tokenizer), doc.text)
    store, _ = open_or_build(small, doc, ctx, settings)
    expect = {
        "model/fingerprint": small.fingerprint,
        "document/sha256": doc.sha256,
        "document/context_tokens": len(ctx),
        "document/doc_start": ctx.doc_start,
        "positions/mode": mode,
    }
    return store, ctx, expect


@pytest.mark.parametrize("case", CASES)
def test_a_reader_written_from_the_format_page_reads_what_sekv_loads(
    small, tmp_path, case, monkeypatch
):
    if case == "raw-rows":  # a machine without the native coder: the records as they are
        monkeypatch.setattr(entropy, "usable", lambda: False)
    store, ctx, expect = built(small, tmp_path, case)
    got = read(store.path, expect, small.model)
    assert got["trace"]["token_ids"].tolist() == ctx.ids
    names = load_safetensors((store.path / "offload.safetensors").read_bytes()).keys()
    assert ("k_rows" in names) == (case == "raw-rows")
    if case == "zero-bit-keys":
        assert (store.resident.codebooks["k_bits"] == 0).any()  # (what the case is for)
    for kind in "kv":  # the records: bit for bit
        flat = store.tier.whole()[f"{kind}_rows"].numpy()
        assert np.array_equal(got["records"][kind].ravel(), flat)
    # keys and values: sekv's own reconstruction up to float32 sums (a step off by 3e-4, or
    # basis^T for basis^-1, is off by 1e-4 .. 1e-2)
    memory = SpanMemory(store, Rope(small.model), "cpu", torch.float32)
    L, H, S, _ = got["keys"].shape
    spans = torch.arange(memory.n_spans)
    for layer in range(L):
        for h in range(H):
            k, v = memory.reconstruct(layer, spans, torch.full_like(spans, h), rotate=False)
            for mine, theirs in ((got["keys"], k), (got["values"], v)):
                err = (mine[layer, h].float() - theirs).abs().max() / theirs.abs().max()
                assert err < 1e-5, (layer, h, float(err))
    # the sketch rows: a level apart on the rare boundaries the page allows, at most
    R = got["sketch"].shape[-1]
    off = (got["sketch"] - dequantize_sketch(store.resident.sketch, R, torch.float32)).abs()
    assert float(off.max()) <= 1 and int((off > 0).sum()) <= 1 + 1e-5 * off.numel()
    stored = got["stored_sketch"]  # a book's are stored: the rows sekv routes with
    assert (stored is not None) == (store.manifest["positions"]["mode"] == "bounded")
    if stored is not None:
        mine = dequantize_sketch(store.resident.sketch, R, torch.float32)
        assert torch.equal(torch.from_numpy(stored).float(), mine)
    if case == "original":  # and the model's own K/V within the default codes' error
        pre = prefill(small.model, ctx.ids, 512)
        keys = rotated(small.model, got["keys"], got["at"])
        for mine, exact in ((keys, pre.keys), (got["values"], pre.values)):
            exact = exact.double()[:, :, got["at"]]  # (a token off: error > 1)
            assert float((mine - exact).norm() / exact.norm()) < 0.15


def resign(path, change=lambda manifest: None, file: str = "offload.safetensors") -> None:
    """Change the manifest, record ``file``'s bytes as they are now and recompute the digest,
    as a forger would."""
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    data = (path / file).read_bytes()
    manifest["files"][file] = {
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
    }
    manifest["digest"] = digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def flip(path, name: str, tensor: str | None = None) -> None:
    """Flip one bit of file ``name``: in its middle, or in the middle of ``tensor``'s bytes."""
    data = bytearray((path / name).read_bytes())
    at = len(data) // 2
    if name == "manifest.json":  # a hex digit of a sha256: still JSON
        at = data.index(b'"sha256"') + 12
    elif tensor is not None:  # safetensors: 8-byte header length, JSON header, data
        size = int.from_bytes(data[:8], "little")
        start, end = json.loads(data[8 : 8 + size])[tensor]["data_offsets"]
        at = 8 + size + (start + end) // 2
    data[at] ^= 0x10
    (path / name).write_bytes(bytes(data))


def other_length(manifest):
    manifest["document"]["context_tokens"] += 1


DAMAGE = {  # what is changed: why the reader refuses
    "offload": (lambda p: flip(p, "offload.safetensors"), "offload.safetensors"),
    "resident": (lambda p: flip(p, "resident.safetensors"), "resident.safetensors"),
    "manifest": (lambda p: flip(p, "manifest.json"), "digest"),
    # re-signed: every checksum recomputed, and still refused
    "field": (lambda p: resign(p, other_length), "context_tokens"),
    "coding": (lambda p: (flip(p, "offload.safetensors", "k_coded"), resign(p)), "coding"),
    "check": (lambda p: (flip(p, "offload.safetensors", "v_check"), resign(p)), "tables"),
}


def test_a_short_documents_store_holds_its_tokens_resident_and_no_codes(small, tmp_path):
    """Its spans would not pay for their codes' and sketch's tables: the reader finds every
    context token's K and V among the fixed rows, sekv's own, and nothing else."""
    doc = document(tmp_path, "The ferry to Holm leaves the quay at seven.")
    ctx = encode_context(small.tokenizer, chat_template(small.tokenizer), doc.text)
    store, _ = open_or_build(small, doc, ctx, StoreSettings())
    expect = {"document/sha256": doc.sha256, "document/context_tokens": len(ctx)}
    got = read(store.path, expect, small.model)
    assert got["fixed_pos"].tolist() == list(range(len(ctx)))
    assert set(got["trace"]["roles"].tolist()) <= {0, 1}  # sinks and anchors only
    memory = SpanMemory(store, Rope(small.model), "cpu", torch.float32)
    pre = prefill(small.model, ctx.ids, 512)  # the model's own K/V, within 8 bits' error
    exact_kv = (pre.keys, pre.values)
    for mine, theirs, exact in zip(got["fixed"], memory.fixed, exact_kv, strict=True):
        assert torch.allclose(mine.float(), theirs.read(torch.float32), rtol=1e-3, atol=1e-6)
        assert float((mine - exact.double()).norm() / exact.double().norm()) < 0.01
    with_codes = tmp_path / "with-codes"  # a store of no spans that holds a code is refused
    shutil.copytree(store.path, with_codes)
    tensors = load_safetensors((with_codes / "resident.safetensors").read_bytes())
    tensors["k_mean"] = np.zeros((1, 1, 16), np.float16)
    save_safetensors(tensors, str(with_codes / "resident.safetensors"))
    resign(with_codes, file="resident.safetensors")
    with pytest.raises(Refused, match="holds more"):
        read(with_codes, expect, small.model)


@pytest.mark.parametrize("damage", DAMAGE)
def test_the_reader_refuses_a_store_with_one_byte_or_field_changed(small, tmp_path, damage):
    store, _, expect = built(small, tmp_path, "original")
    read(store.path, expect, small.model)  # as built: read
    change, reason = DAMAGE[damage]
    change(store.path)
    with pytest.raises(Refused, match=reason):
        read(store.path, expect, small.model)
