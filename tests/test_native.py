"""The decode step's native kernels (sekv_core/native/) decide as the tensor code."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from sekv_core.kvquant import quantize_rows
from sekv_core.native import build as native
from sekv_core.native import kernels
from sekv_core.prompt import chat_template, encode_question
from sekv_core.rope import Rope
from sekv_core.sketch import column_major, reads_natively
from sekv_core.store.codes import fit_code
from sekv_core.zoom.pools import ZoomPool
from sekv_core.zoom.router import SketchRouter, TrainedRouter, select
from sekv_core.zoom.trace import ZoomTrace
from sekv_core.zoom.zoomnet import NetShape, ZoomNet

pytestmark = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler on this machine"
)


@pytest.fixture
def tensor_code(monkeypatch):
    """Run the tensor code (what a GPU runs) instead of the kernels inside the block."""

    def run(fn, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(kernels, "usable", lambda *tensors: False)
            return fn(*args, **kwargs)

    return run


def test_the_kernels_build_and_load(tmp_path):
    assert native.library() is not None
    assert native.usable(torch.zeros(2, 3))
    assert not native.usable(torch.zeros(2, 3).t())  # not contiguous: the tensor code
    assert not native.usable(torch.zeros(2, requires_grad=True))


def test_a_damaged_library_is_built_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SEKV_HOME", str(tmp_path))
    compiler = shutil.which("cc") or shutil.which("gcc")
    path = native._built(compiler)
    path.write_bytes(b"not a library")
    native.library.cache_clear()
    try:
        assert native.library() is not None
        assert path.read_bytes()[:4] == b"\x7fELF"
    finally:
        native.library.cache_clear()


def scores_with_ties(g: torch.Generator, H: int, N: int) -> torch.Tensor:
    """Widened scores: a span and its neighbours often share a score."""
    raw = torch.randn(H, N, generator=g) * 3
    return torch.nn.functional.max_pool1d(raw[:, None], 3, 1, 1)[:, 0]


def test_select_decides_as_the_tensor_code_ties_included(tensor_code):
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        N = int(torch.randint(1, 1200, (1,), generator=g))
        scores = scores_with_ties(g, 3, N)
        lengths = torch.randint(1, 12, (N,), generator=g)
        budget = int(torch.randint(0, 400, (1,), generator=g))
        margin = None if trial % 4 == 0 else 6.0
        rounds = 1 + trial % 5
        zoom, threshold = select(scores, lengths, budget, margin, rounds)
        want, want_threshold = tensor_code(select, scores, lengths, budget, margin, rounds)
        assert torch.equal(threshold, want_threshold)
        assert torch.equal(zoom, want), trial
        assert (lengths * zoom).sum(dim=1).le(budget).all()


def test_select_of_equal_scores_goes_in_document_order():
    scores = torch.zeros(1, 6)
    lengths = torch.tensor([3, 3, 3, 3, 3, 3])
    zoom, _ = select(scores, lengths, budget=9, margin=1.0)
    assert zoom[0].tolist() == [True, True, True, False, False, False]


def test_the_trace_records_as_the_tensor_code(tensor_code):
    g = torch.Generator().manual_seed(2)
    L, H, N = 3, 2, 50
    lengths = torch.randint(1, 9, (N,), generator=g)
    fast, slow = ZoomTrace(), ZoomTrace()
    for _ in range(6):
        for layer in range(L):
            scores = scores_with_ties(g, H, N)
            zoom, threshold = select(scores, lengths, 60, 4.0)
            fast.record(layer, L, zoom, scores, threshold, lengths)
            tensor_code(slow.record, layer, L, zoom, scores, threshold, lengths)
    for name in ("zoomed", "best_margin", "best_score", "tokens_max", "question_zoom"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    assert fast.spans() == slow.spans()


def pool_state(pool) -> dict[str, torch.Tensor]:
    codes, scale = pool.rows.tensors()
    names = ("owner", "last", "token", "held", "active", "bias")
    return {"codes": codes, "scale": scale} | {n: getattr(pool, n) for n in names}


def test_pool_updates_place_rows_as_the_tensor_code(tiny_loaded, tmp_path, tensor_code):
    """A run of picks under a tight budget (evictions, a span dropped and picked again, a pool
    that must widen): the native update leaves every slot, row and flag as the tensor code."""
    from test_attention import sekv_method

    method, _ = sekv_method(tiny_loaded, tmp_path)
    memory = method.spans
    H, N = memory.num_kv_heads, memory.n_spans
    budget = int(memory.lengths[: max(2, N // 3)].sum())
    g = torch.Generator().manual_seed(3)
    picks = []
    for step in range(12):
        zoom = torch.rand(H, N, generator=g) < 0.3
        if step == 5:
            zoom[:] = True  # more than the budget: the pool widens
        picks.append(zoom)
    memory.clear()
    fast, slow, counts = {}, {}, {}
    for step, zoom in enumerate(picks):
        for name, pools in (("fast", fast), ("slow", slow)):
            memory.pools = pools  # each run its own pool of layer 0
            before = memory.reconstructions
            if name == "fast":
                memory.zoom_pool(0, zoom, budget)
            else:
                tensor_code(memory.zoom_pool, 0, zoom, budget)
            counts[name] = memory.reconstructions - before
        assert counts["fast"] == counts["slow"], step
        a, b = pool_state(fast[0]), pool_state(slow[0])
        for key in a:
            assert torch.equal(a[key], b[key]), (step, key)
        read = memory.pool_entries(0, fast[0], torch.float32)  # what attention reads
        want = tensor_code(memory.pool_entries, 0, slow[0], torch.float32)
        for got, expected in zip(read, want, strict=True):
            assert torch.equal(got, expected), step
    assert fast[0].owner.shape[1] > budget  # it widened
    assert fast[0].in_native_code(picks[0], memory.host_lengths, memory.first_row)


def test_rows_are_encoded_as_the_tensor_code():
    """8-bit rows of any magnitude (all zero, subnormal scales, large values, ties at half a
    step) get the codes and fp16 scales of :func:`sekv_core.kvquant.quantize_rows`."""
    g = torch.Generator().manual_seed(4)
    T, D = 64, 16
    rows = torch.randn(2, T, D, generator=g) * torch.logspace(-9, 4, T)[None, :, None]
    rows[0, 0] = 0.0
    rows[1, 1] = torch.arange(D) - 7.5  # scale 8.5 / 127: many values near half a step
    zoom = torch.ones(1, 1, dtype=torch.bool)
    pool = ZoomPool.empty(zoom, T, head_dim=D, kv_bits=8, device=torch.device("cpu"))
    heads, spans = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    lengths, first_row = torch.tensor([T]), torch.tensor([0])
    kernels.place(pool, zoom, heads, spans, lengths, first_row, rows[0], rows[1])
    codes, scale = quantize_rows(rows)
    assert torch.equal(pool.rows.codes[:, 0], codes)
    assert torch.equal(pool.rows.scale[:, 0], scale)
    assert pool.token[0].tolist() == list(range(T)) and pool.owner[0].eq(0).all()


@pytest.mark.parametrize("spec", ["even:0.02", "even:0.175", "even:1", "even:4", "*x16", "*x4"])
def test_records_decode_as_the_tensor_code(spec, tensor_code):
    """Every code a store can be written in (even codes' bit fields, 0 to 8 bits a direction;
    4-bit and fp16 tier codes) decodes to the same rows natively."""
    g = torch.Generator().manual_seed(5)
    L, H, S, D = 2, 3, 70, 64
    x = torch.randn(L, H, S, D, generator=g) * torch.logspace(0, -2, D)
    x[0, 1, 3] *= 1e4  # an atypical row
    code = fit_code(x, spec, moment=torch.eye(D).expand(L, H, D, D))
    records = code.encode(x)
    for layer in range(L):
        flat = records[layer].reshape(H * S, -1)
        heads = [S] * H
        got = code.decode(flat, layer, heads, torch.float32)
        want = tensor_code(code.decode, flat, layer, heads, torch.float32)
        assert torch.equal(got, want), layer


def test_sketch_scores_are_the_tensor_codes_to_float_rounding(tensor_code):
    g = torch.Generator().manual_seed(6)
    L, H, D, R, G = 2, 3, 16, 8, 3
    lengths = torch.randint(1, 9, (150,), generator=g)
    S = int(lengths.sum())
    packed = torch.randint(0, 256, (L, H, S, R // 2), generator=g, dtype=torch.uint8)
    memory = SimpleNamespace(
        sketch=column_major(packed),
        sketch_proj=torch.randn(L, H, D, R, generator=g),
        sketch_scale=torch.rand(L, H, R, generator=g),
        sketch_mean=torch.randn(L, H, D, generator=g),
        first_row=torch.cumsum(lengths, 0) - lengths,
        host_lengths=lengths,
        sketch_span=torch.repeat_interleave(torch.arange(150), lengths),
        n_spans=150,
    )
    router = SketchRouter()
    for layer in range(L):
        for Tq in (1, 5):
            q = torch.randn(H, G, Tq, D, generator=g)
            got = router.scores(memory, layer, q, 0.25)
            want = tensor_code(router.scores, memory, layer, q, 0.25)
            assert got.shape == (H, 150)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    memory.sketch = column_major(packed.flip(2))  # a new sketch: not scored from the old one
    want = tensor_code(router.scores, memory, 1, q, 0.25)
    assert torch.allclose(router.scores(memory, 1, q, 0.25), want, rtol=1e-5, atol=1e-5)
    row_major = SimpleNamespace(**{**vars(memory), "sketch": packed})  # a growing sketch
    assert not reads_natively(row_major, 0, q)


def test_trained_router_scores_are_the_tensor_codes_to_float_rounding(tensor_code):
    """The gate in one native pass (every term weighted, a sketch scale wider than one) gives the
    tensor code's scores; its mapped span keys are made once per layer and sketch."""
    g = torch.Generator().manual_seed(8)
    L, H, D, R, G, N = 2, 3, 16, 8, 3, 150
    lengths = torch.randint(1, 9, (N,), generator=g)
    S = int(lengths.sum())
    packed = torch.randint(0, 256, (L, H, S, R // 2), generator=g, dtype=torch.uint8)
    memory = SimpleNamespace(
        sketch=column_major(packed),
        sketch_proj=torch.randn(L, H, D, R, generator=g),
        sketch_scale=torch.rand(L, H, R, generator=g) * 2,
        sketch_mean=torch.randn(L, H, D, generator=g),
        first_row=torch.cumsum(lengths, 0) - lengths,
        host_lengths=lengths,
        lengths=lengths,
        log_len=lengths.float().log(),
        sketch_span=torch.repeat_interleave(torch.arange(N), lengths),
        n_spans=N,
    )
    net = ZoomNet(NetShape(num_layers=L, num_heads=H * G, num_kv_heads=H, head_dim=D))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    router = TrainedRouter(net)
    with torch.inference_mode():
        for layer in range(L):
            for Tq in (1, 5):
                q = torch.randn(H, G, Tq, D, generator=g) * 2
                got = router.scores(memory, layer, q, 0.25)
                want = tensor_code(TrainedRouter(net).scores, memory, layer, q, 0.25)
                assert got.shape == (H, N)
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
            kept = router.gate_layer(memory, layer, torch.float32)
            assert kept.native is not None and router.gate_layer(memory, layer, q.dtype) is kept
        memory.sketch = column_major(packed.clone())  # a new sketch: its keys made again
        assert router.gate_layer(memory, 0, torch.float32) is not kept


def test_keys_rotate_as_the_tensor_code(tiny_loaded, tensor_code):
    rope = Rope(tiny_loaded.model)
    g = torch.Generator().manual_seed(7)
    D = rope.table(1, torch.zeros(1)).shape[1] // 2  # the heads' dimension
    keys = torch.randn(300, D, generator=g)
    positions = torch.randint(0, 1500, (300,), generator=g)
    got = rope.rotate(keys, positions)
    assert torch.equal(got, tensor_code(rope.rotate, keys, positions))
    assert not torch.equal(got, keys)


def test_an_answer_is_the_tensor_codes_trace_and_sources_included(
    tiny_loaded, tmp_path, tensor_code
):
    """A whole answer (routing, pools, reconstruction, attention, the trace) gives the same
    tokens, attention shares and per-token attention natively as in the tensor code, and the
    router's scores to float rounding."""
    from test_attention import sekv_method

    method, _ = sekv_method(tiny_loaded, tmp_path, budget=40)
    tok = tiny_loaded.tokenizer
    question = encode_question(tok, chat_template(tok), "Where is item 4 kept?")

    def answer():
        tokens = list(method.generate(question, 8))
        trace = method.policy.trace
        return tokens, trace.mass.clone(), trace.answer.clone(), trace.spans()

    fast, slow = answer(), tensor_code(answer)
    assert fast[0] == slow[0]
    assert torch.equal(fast[1], slow[1]) and torch.equal(fast[2], slow[2])
    assert len(fast[3]) == len(slow[3])
    for a, b in zip(fast[3], slow[3], strict=True):  # router scores: the same to float rounding
        assert a == b | {key: pytest.approx(b[key], rel=1e-5) for key in ("score", "threshold")}
    assert fast[2].amax() > 0
