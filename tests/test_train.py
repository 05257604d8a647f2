"""The trained zoom-in: gradients, loss decrease, router files, model checks, CLI."""

from __future__ import annotations

import copy

import pytest
import torch

from sekv_core.config import StoreSettings
from sekv_core.errors import SekvError
from sekv_core.router_files import load_router, resolve_router, save_router
from sekv_core.train.evaluate import held_out_score
from sekv_core.train.examples import prepare
from sekv_core.train.losses import losses
from sekv_core.train.settings import TrainSettings
from sekv_core.train.student import answer_steps, step_decisions, student_forward
from sekv_core.train.teacher import zoom_targets
from sekv_core.zoom.zoomnet import NetShape, ZoomNet, step_best

SMALL = TrainSettings(steps=4, docs=1, held_out=1, doc_tokens=(120, 160), save_every=2)


def shape_of(loaded, dim=4) -> NetShape:
    c = loaded.model.config
    return NetShape(
        loaded.spec.num_layers,
        c.num_attention_heads,
        loaded.spec.num_kv_heads,
        loaded.spec.head_dim,
        dim,
    )


@pytest.fixture(scope="module")
def prepared(tiny_model_dirs, tmp_path_factory):
    """A tiny llama (GQA) with one prepared training document (built once for the module)."""
    import os

    from sekv_core.models import load_model

    os.environ["SEKV_HOME"] = str(tmp_path_factory.mktemp("train-home"))
    loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu")
    loaded.model.requires_grad_(False)
    docs, examples, held = prepare(loaded, SMALL, log=lambda _: None, store=StoreSettings())
    return loaded, docs, examples, held


def test_zoom_targets_pick_fewest_spans_holding_rho():
    mass = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.01, 0.01, 0.0, 0.0]])
    mined, targets = zoom_targets(mass, rho=0.9)
    assert mined.tolist() == [True, False]  # the second position barely looks at spans
    assert targets[0].tolist() == [True, True, True, False]  # 0.5 + 0.3 < 0.9 <= + 0.15


def test_gradients_reach_only_the_router_and_base_is_unchanged(prepared):
    loaded, docs, examples, _ = prepared
    net = ZoomNet(shape_of(loaded))
    base = copy.deepcopy(loaded.model.state_dict())
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    ex = examples[0]
    parts = losses(loaded, net, docs[ex.doc], ex, SMALL)
    parts["loss"].backward()
    assert all(p.grad is None for p in loaded.model.parameters())
    grads = {n: p.grad for n, p in net.named_parameters()}
    assert all(g is not None for g in grads.values())
    assert grads["gate.threshold"].abs().sum() > 0  # the zoom threshold learns
    assert grads["gate.route_weight"].abs().sum() > 0  # so does the routing term
    opt.step()
    after = loaded.model.state_dict()
    assert all(torch.equal(base[k], after[k]) for k in base)


def test_student_with_every_span_zoomed_is_the_teacher(prepared):
    """Gate wide open: the student's attention covers every context token exactly -> KL = 0."""
    loaded, docs, examples, _ = prepared
    net = ZoomNet(shape_of(loaded))
    with torch.no_grad():
        net.gate.threshold.fill_(-1e4)
        logits, _ = student_forward(loaded, net, docs[examples[0].doc], examples[0], 10**6)
    teacher = examples[0].teacher_logp
    assert torch.allclose(logits.log_softmax(-1), teacher, atol=2e-3)


def test_step_decisions_use_only_each_steps_queries():
    """The question's decision ignores the answer's queries; each answer token routes alone."""
    z = torch.full((1, 2, 5, 3), -1.0)  # (Hkv, G, Tq, N): 3 question + 2 answer positions
    z[0, 1, 4, 2] = 5.0  # only the last answer token's query wants span 2
    z[0, 0, 1, 0] = 2.0  # a question query wants span 0
    steps = answer_steps(5, answer_len=2)
    assert steps.tolist() == [0, 0, 0, 1, 2]
    _, hard = step_decisions(z, steps, torch.tensor([4, 4, 4]), budget=100, neighbours=0)
    assert hard[0].tolist() == [
        [True, False, False],  # question prefill: span 0 only
        [False, False, False],  # first answer token: nothing above 0
        [False, False, True],  # second answer token: span 2
    ]
    # spans widened to their neighbours as answering widens them; gradients stay each span's
    best, wide = step_decisions(z, steps, torch.tensor([4, 4, 4]), budget=100, neighbours=1)
    assert wide[0].tolist() == [[True, True, False], [False, False, False], [False, True, True]]
    assert torch.equal(best, step_best(z, steps))


def test_student_prediction_does_not_see_later_answer_tokens(prepared):
    """Causal student: the prediction of answer token i (its zoom decisions included) is the
    one a run cut right after token i - 1 makes, as answering would (it has no later tokens)."""
    loaded, docs, examples, _ = prepared
    ex = copy.copy(max(examples, key=lambda e: e.answer_len))
    ex.ids = ex.ids[-ex.answer_len - 2 :]  # a 2-token question: the answer's queries outnumber it
    net = ZoomNet(shape_of(loaded))
    with torch.no_grad():  # a gate ruled by the queries (not the sketch)
        net.gate.route_weight.fill_(10.0)
        net.gate.sketch_weight.zero_()
        net.gate.threshold.fill_(0.0)
    doc = docs[ex.doc]
    budget = int(doc.memory.lengths.max())
    with torch.no_grad():
        full, _ = student_forward(loaded, net, doc, ex, budget)
        for k in range(1, ex.answer_len):
            cut = copy.copy(ex)
            cut.ids, cut.answer_len = ex.ids[: len(ex.ids) - ex.answer_len + k], k
            part, _ = student_forward(loaded, net, doc, cut, budget)
            assert torch.allclose(part, full[:k], atol=1e-5), k


def test_a_few_steps_reduce_the_loss(prepared):
    loaded, docs, examples, _ = prepared
    torch.manual_seed(0)
    net = ZoomNet(shape_of(loaded))
    opt = torch.optim.Adam(net.parameters(), lr=5e-2)
    ex = examples[0]

    def loss() -> float:
        torch.manual_seed(1)  # the same sampled budget each time
        return float(losses(loaded, net, docs[ex.doc], ex, SMALL, share=0.2)["loss"].detach())

    before = loss()
    for _ in range(12):
        opt.zero_grad()
        losses(loaded, net, docs[ex.doc], ex, SMALL, share=0.2)["loss"].backward()
        opt.step()
    assert loss() < 0.9 * before


def test_router_file_round_trip_and_model_check(tmp_path, prepared):
    loaded, *_ = prepared
    net = ZoomNet(shape_of(loaded))
    with torch.no_grad():
        net.gate.threshold.uniform_(-3, 3)
    path = tmp_path / "r.safetensors"
    save_router(path, net, {"model": {"id": "tiny", "fingerprint": loaded.fingerprint}}, None)
    back = load_router(path, loaded.fingerprint)
    assert back.manifest["model"]["id"] == "tiny"
    for k, v in net.state_dict().items():
        assert torch.equal(v, back.net.state_dict()[k])
    assert resolve_router(str(path), loaded.fingerprint).net is not None
    with pytest.raises(SekvError, match="no router file"):  # training-free is a method's choice
        resolve_router("sketch", loaded.fingerprint)
    # a router trained beside a rank gate (stores before the coded offload tier) still loads
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    old = tmp_path / "old.safetensors"
    save_file({**tensors, "rank.bias": torch.zeros(2, 3, 4)}, str(old), metadata=meta)
    assert torch.equal(load_router(old).net.gate.threshold, net.gate.threshold)
    with pytest.raises(SekvError, match="trained for tiny"):
        load_router(path, "another-fingerprint", "other-model")
    (tmp_path / "bad.safetensors").write_bytes(b"not a router")
    with pytest.raises(SekvError, match="not a sekv router"):
        load_router(tmp_path / "bad.safetensors")
    with pytest.raises(SekvError, match="no router file"):
        load_router(tmp_path / "missing.safetensors")


def test_cli_trains_resumes_and_ask_uses_the_router(tmp_path, tiny_model_dirs, sekv_home):
    from typer.testing import CliRunner

    from sekv_cli.main import app

    model = str(tiny_model_dirs["llama"])
    out = tmp_path / "router.safetensors"
    args = ["train", "--model", model, "--docs", "1", "--held-out", "1"]
    args += ["--doc-tokens", "100,140", "--out", str(out)]
    runner = CliRunner()
    first = runner.invoke(app, [*args, "--steps", "2"])
    assert first.exit_code == 0, first.output
    assert out.exists() and out.with_name(out.name + ".state").exists()
    manifest = load_router(out).manifest
    assert manifest["step"] == 2 and manifest["selected_step"] in (0, 2)
    # model selection: the kept weights are never worse on held-out data than the untrained start
    assert held_out_score(manifest["metrics"]) <= held_out_score(manifest["training_free_metrics"])
    if manifest["selected_step"] == 0:
        assert manifest["metrics"] == manifest["training_free_metrics"]
    again = runner.invoke(app, [*args, "--steps", "3"])
    assert again.exit_code == 0, again.output
    assert "resuming" in again.output and load_router(out).manifest["step"] == 3
    # the weights the first run kept stay a candidate: resuming never ends worse on held-out data
    resumed = load_router(out).manifest
    assert held_out_score(resumed["metrics"]) <= held_out_score(manifest["metrics"])
    done = runner.invoke(app, [*args, "--steps", "3"])
    assert done.exit_code == 0 and "nothing to do" in done.output

    # `sekv ask` routes with the router the user trained for the model (``auto``, its only
    # choice); sekv-training-free never does; a book (a streamed, bounded memory) routes
    # training-free unless sekv-trained is asked for
    import shutil

    from sekv_core.config import MethodSettings
    from sekv_core.documents import load_document
    from sekv_core.engine import Session
    from sekv_core.models import load_model

    (sekv_home / "routers").mkdir(parents=True, exist_ok=True)
    shutil.copy(out, sekv_home / "routers" / out.name)
    doc = tmp_path / "doc.txt"
    doc.write_text("The keeper is named Orla. " * 30)
    ask = ["ask", str(doc), "Who is the keeper?", "--model", model]
    asked = runner.invoke(app, [*ask, "--json", "--max-new-tokens", "4"])
    assert asked.exit_code == 0, asked.output
    assert '"router": "trained"' in asked.output
    shown = runner.invoke(app, [*ask, "--show-zoom", "--max-new-tokens", "2"])
    assert shown.exit_code == 0, shown.output
    assert "zoom: at most" in shown.output and "trained router" in shown.output
    assert "gate > 0" not in shown.output  # the router's rule: diagnostics, with --verbose
    shown = runner.invoke(app, [*ask, "--show-zoom", "--verbose", "--max-new-tokens", "2"])
    # a learned gate has no margin: the diagnostics name its rule
    assert shown.exit_code == 0, shown.output
    assert "routing: trained router" in shown.output and "gate > 0" in shown.output
    assert "learned on" not in shown.output  # the router's own spans: no warning

    loaded = load_model(model)
    free = Session(loaded, load_document(doc), "sekv-training-free")
    assert free.ask("Who is the keeper?", 2).routing["router"] == "training-free"
    book = tmp_path / "book.txt"  # beyond the tiny model's 2048-token window
    book.write_text("The keeper is named Orla. The lamp is lit at dusk. " * 220)
    for method, routed in (("sekv", "training-free"), ("sekv-trained", "trained")):
        session = Session(loaded, load_document(book), method)
        assert session.method.spans.bounded
        assert session.ask("Who is the keeper?", 2).routing["router"] == routed, method

    # the router records what it routed over; a store of other span lengths gets a warning
    router = load_router(out)
    assert router.manifest["routing"] == {"span_tokens": [4, 8], "neighbours": 1}
    router.manifest["routing"]["span_tokens"] = [24, 64]
    longer = tmp_path / "longer.safetensors"
    save_router(longer, router.net, router.manifest, None)
    warnings: list[str] = []
    settings = MethodSettings(router=str(longer), warn=warnings.append)
    Session(loaded, load_document(doc), "sekv", settings).ask("Who?", 2)
    assert any("learned on 24-64-token spans" in w and "4-8 tokens" in w for w in warnings)

    # a router trained for another model is refused
    router = load_router(out)
    router.manifest["model"]["fingerprint"] = "0" * 32
    foreign = tmp_path / "foreign.safetensors"
    save_router(foreign, router.net, router.manifest, None)
    with pytest.raises(SekvError, match="trained for"):
        Session(loaded, load_document(doc), "sekv", MethodSettings(router=str(foreign)))


def test_sketch_spans_match_the_sketch_token_by_token(prepared):
    """The gate's span features are exact functions of the resident sketch: per-span max and
    log-sum-exp of the estimated logits, and a mean key whose logit is their mean."""
    from sekv_core.sketch import sketch_logits, span_mean_keys
    from sekv_core.zoom.zoomnet import sketch_spans

    loaded, docs, _, _ = prepared
    memory = docs[0].memory
    torch.manual_seed(3)
    H, D = memory.num_kv_heads, memory.head_dim
    G = loaded.model.config.num_attention_heads // H
    q = torch.randn(H, G, 5, D)
    scaling = D**-0.5
    for layer in range(memory.num_layers):
        spans = sketch_spans(memory, layer, q, scaling)

        def mean_keys(through=None, spans=spans):  # as the gate reads them
            return span_mean_keys(spans.memory, spans.layer, through, spans.rows)

        logits = sketch_logits(memory, layer, q).float() * scaling  # (H, G, Tq, S)
        mean_logit = torch.einsum("hgtd,hnd->hgtn", q, mean_keys()) * scaling
        for n in range(memory.n_spans):
            rows = logits[..., memory.sketch_span == n]
            assert torch.allclose(spans.max_logit[..., n], rows.amax(-1), atol=1e-5)
            assert torch.allclose(spans.log_mass[..., n], rows.logsumexp(-1), atol=1e-4)
            assert torch.allclose(mean_logit[..., n], rows.mean(-1), atol=1e-3)
        through = torch.randn(H, G, D, 3)  # the gate maps mean keys without forming them
        mapped = torch.einsum("hnd,hgdr->hgnr", mean_keys(), through)
        assert torch.allclose(mean_keys(through), mapped, atol=1e-4)


def test_untrained_gate_is_the_training_free_rule_and_places_nothing_more(prepared):
    """At initialisation the gate scores every span as the training-free router does (its max
    estimated logit over the decision's queries, relative to the best span, + the margin): when
    answering (one decision) and in training (one per step, from that step's queries only).
    Routing with it places nothing on the device beyond the training-free tier."""
    from sekv_core.zoom.router import SketchRouter, TrainedRouter
    from sekv_core.zoom.zoomnet import INIT_MARGIN, sketch_spans

    loaded, docs, _, _ = prepared
    memory = docs[0].memory
    net = ZoomNet(shape_of(loaded))
    H, D = memory.num_kv_heads, memory.head_dim
    G = loaded.model.config.num_attention_heads // H
    torch.manual_seed(5)
    q = torch.randn(H, G, 6, D) * 4  # logits spread wider than the margin
    steps = torch.tensor([0, 0, 0, 1, 2, 2])
    before = memory.resident_bytes()
    for layer in range(memory.num_layers):
        free = SketchRouter().scores(memory, layer, q, D**-0.5)
        gate = TrainedRouter(net).scores(memory, layer, q, D**-0.5)
        assert torch.allclose(gate, free - free.amax(1, keepdim=True) + INIT_MARGIN, atol=1e-4)
        spans = sketch_spans(memory, layer, q, D**-0.5)
        z = net.gate.logits(layer, q, spans, memory.log_len, D**-0.5, steps)
        best = step_best(z, steps)  # (H, P, N)
        for step in range(3):
            free = SketchRouter().scores(memory, layer, q[:, :, steps == step], D**-0.5)
            want = free - free.amax(1, keepdim=True) + INIT_MARGIN
            assert torch.allclose(best[:, step], want, atol=1e-4)
    assert memory.resident_bytes() == before  # nothing beyond the training-free tier


def test_training_distils_along_the_full_kv_models_own_answer(prepared, tmp_path):
    """By default the answer an example distils along is what full KV answers greedily (the
    answer `sekv bench fidelity` compares along), and the teacher's cache is left unchanged."""
    from sekv_core.documents import load_document
    from sekv_core.engine import Session
    from sekv_core.methods.full import prefill_cache
    from sekv_core.prompt import chat_template, encode_context, encode_question
    from sekv_core.train.teacher import teacher_answer

    loaded = prepared[0]
    path = tmp_path / "doc.txt"
    path.write_text("The spare key cabinet is kept in room 412. " * 12)
    session = Session(loaded, load_document(path), "full")
    question = "Where is the spare key cabinet kept?"
    want = session.ask(question, max_new_tokens=8)
    template = chat_template(loaded.tokenizer)
    context = encode_context(loaded.tokenizer, template, session.document.text)
    cache = prefill_cache(loaded.model, context.ids, 512)
    q = encode_question(loaded.tokenizer, template, question)
    got = teacher_answer(loaded, cache, len(context), q, 8)
    assert loaded.tokenizer.decode(got, skip_special_tokens=True) == want.answer
    assert cache.get_seq_length() == len(context)


def test_a_router_per_model_for_a_gguf_model(tmp_path, tiny_gguf, tiny_model_dirs, sekv_home):
    """`sekv train --model X.gguf's folder` (Qwen2.5-0.5B's head groups: 14 query heads, 2 KV)
    keeps the router under the model's fingerprint; `sekv ask` with that model routes with it
    and says which file; with another model it routes training-free and says so."""
    import json
    from pathlib import Path

    from typer.testing import CliRunner

    from sekv_cli.main import app
    from sekv_core.models import load_model
    from sekv_core.router_files import user_router_path

    runner = CliRunner()
    model = str(tiny_gguf)
    args = ["train", "--model", model, "--steps", "2", "--docs", "1", "--held-out", "1"]
    trained = runner.invoke(app, [*args, "--doc-tokens", "100,140", "--json"])
    assert trained.exit_code == 0, trained.output
    path = Path(json.loads(trained.stdout)["router"])
    loaded = load_model(model, device="cpu")
    assert path == user_router_path(loaded.model_id, loaded.fingerprint)
    assert path.parent == sekv_home / "routers" and path.is_file()
    assert path.name.startswith("tiny-qwen2.Q8_0-")
    router = load_router(path, loaded.fingerprint, loaded.model_id)
    assert router.manifest["model"] == {"id": loaded.model_id, "fingerprint": loaded.fingerprint}
    assert router.net.shape == NetShape(2, 14, 2, 16, router.net.shape.dim)
    copy = tmp_path / "copy.safetensors"  # the file round-trips
    save_router(copy, router.net, router.manifest, None)
    back = load_router(copy, loaded.fingerprint)
    assert back.manifest == router.manifest and back.path == copy
    for name, tensor in router.net.state_dict().items():
        assert torch.equal(tensor, back.net.state_dict()[name])

    doc = tmp_path / "doc.txt"
    doc.write_text("The keeper is named Orla. The lamp is lit at dusk. " * 12)
    for name, routed, used in (
        (model, "trained", str(path)),
        (str(tiny_model_dirs["llama"]), "training-free", None),
    ):
        ask = ["ask", str(doc), "Who is the keeper?", "--model", name, "--max-new-tokens", "2"]
        asked = runner.invoke(app, [*ask, "--json"])
        assert asked.exit_code == 0, asked.output
        routing = json.loads(asked.stdout)["routing"]
        assert (routing["router"], routing["router_file"]) == (routed, used), name
        shown = runner.invoke(app, [*ask, "--show-zoom"])
        assert shown.exit_code == 0, shown.output
        says = f"trained router {path}" if used else "training-free router"
        assert f"per layer and KV head, {says}\n" in shown.stdout, shown.stdout
