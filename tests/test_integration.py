"""The real embedded default model answering questions about the shipped sample documents."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sekv_core.api import open_documents
from sekv_core.conversation import Conversation
from sekv_core.documents import load_document
from sekv_core.engine import Session

SAMPLES = Path(__file__).resolve().parent.parent / "sample_docs"
pytestmark = pytest.mark.integration


def qa(name: str) -> list[dict]:
    return json.loads((SAMPLES / name).with_suffix(".qa.json").read_text())


@pytest.mark.parametrize("doc", ["handbook.pdf", "lighthouse.md"])
def test_full_kv_answers_sample_questions(default_model, doc):
    session = Session(default_model, load_document(SAMPLES / doc), "full")
    questions = qa(doc)
    correct, log = 0, []
    for item in questions[:4]:
        answer = session.ask(item["question"], max_new_tokens=48)
        ok = item["answer"].lower() in answer.answer.lower()
        correct += ok
        log.append((item["question"], item["answer"], answer.answer, ok))
        if correct >= 2:
            break
    assert correct >= 2, log


def test_cli_ask_on_sample_doc(default_model, shared_home):
    """`sekv ask` with no options answers, routing with the router shipped for the model."""
    item = qa("lighthouse.md")[0]
    env = dict(os.environ, SEKV_HOME=str(shared_home))  # reuses the converted default model
    doc = str(SAMPLES / "lighthouse.md")
    ask = [sys.executable, "-m", "sekv_cli", "ask", doc, item["question"]]
    proc = subprocess.run(ask, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert item["answer"].lower() in proc.stdout.lower()
    assert "Error" not in proc.stderr
    proc = subprocess.run([*ask, "--json"], capture_output=True, text=True, env=env, timeout=600)
    result = json.loads(proc.stdout)
    assert result["routing"]["router"] == "trained", result["routing"]
    assert item["answer"].lower() in result["answer"].lower()


def test_sekv_finds_a_planted_needle(default_model, tmp_path):
    """A needle fact mid-document is answered from the span store by the training-free rule, with
    the needle's span zoomed and resident memory (incl. the zoom peak) at most 20% of the full KV
    cache. (The trained router misses this needle at a 256-token budget: needles at 4K tokens are
    where it answers fewer than the training-free rule, docs/benchmarks.md.)"""
    from sekv_bench.haystack import NEEDLES, haystack
    from sekv_core.methods import MethodSettings

    needle = NEEDLES[2]
    path = tmp_path / "haystack.txt"
    # a haystack whose needle the full-KV model finds (seed 7 it misses: 135M parameters)
    path.write_text(haystack(default_model.tokenizer, 3500, 0.5, needle, seed=3500))
    document = load_document(path)
    assert needle.answer in Session(default_model, document, "full").ask(needle.question, 24).answer
    session = Session(default_model, document, "sekv-training-free", MethodSettings(budget=256))
    assert 3000 <= session.doc_tokens <= 4500
    answer = session.ask(needle.question, max_new_tokens=24)
    assert needle.answer in answer.answer, answer.answer
    mem = answer.memory
    assert mem["resident_bytes"] <= 0.20 * mem["full_kv_bytes"], mem
    # the needle's tokens lie in a span the answer zoomed into
    text = session.document.text
    lo = text.index(needle.fact)
    ctx = session.context
    needle_tokens = {
        ctx.doc_start + i for i, (s, e) in enumerate(ctx.offsets) if lo <= s < lo + len(needle.fact)
    }
    zoomed = [z for z in answer.zoom if needle_tokens & set(range(z["start"], z["end"]))]
    assert zoomed, "the needle's span is missing from the zoom trace"


def test_the_shipped_router_fits_the_default_model(default_model):
    """The router shipped in the package loads for the embedded model (a router format change
    without retraining would leave `sekv ask` and sekv-trained without one) and answers."""
    from sekv_core.router_files import SHIPPED, resolve_router

    router = resolve_router("auto", default_model.fingerprint, default_model.model_id)
    assert router is not None and list(SHIPPED.glob("*.safetensors"))
    share = router.manifest["parameter_share"]
    assert router.net.num_parameters() == router.manifest["parameters"] and share < 0.0005
    item = qa("lighthouse.md")[0]
    session = Session(default_model, load_document(SAMPLES / "lighthouse.md"), "sekv-trained")
    answer = session.ask(item["question"], max_new_tokens=24)
    assert answer.routing["router"] == "trained", answer.routing
    assert item["answer"].lower() in answer.answer.lower(), answer.answer


@pytest.mark.parametrize("method", ["sekv", "full"])
def test_sources_name_the_sentence_and_the_page(default_model, method):
    """The answer's first source is the sentence holding the answer, on its page, from SeKV's
    attention over zoomed tokens as from full KV's over the whole document."""
    item = next(i for i in qa("handbook.pdf") if "Security" in i["question"])
    session = Session(default_model, load_document(SAMPLES / "handbook.pdf"), method)
    answer = session.ask(item["question"], max_new_tokens=32)
    assert item["answer"] in answer.answer
    first = answer.sources[0]
    assert item["answer"] in first["text"], answer.sources
    assert first["page"] == item["page"]
    assert {"Marta", "Quill"} <= set(first["matched"])
    assert 0 < sum(s["share"] for s in answer.sources) <= 1
    if method == "sekv":
        facts = first["zoom"]
        assert 1 <= facts["layers_zoomed"] <= facts["layers"]
        assert 1 <= facts["rank"] <= facts["spans"]


def test_retrieve_cites_the_passage_it_read_the_answer_in(default_model, tmp_path):
    """--method retrieve's sources are sentences of the passages it read, where its answer's
    attention went: the network's name and its page, alone and in a folder (with the file)."""
    item = next(i for i in qa("handbook.pdf") if "wireless" in i["question"])
    session = Session(default_model, load_document(SAMPLES / "handbook.pdf"), "retrieve")
    answer = session.ask(item["question"], max_new_tokens=24)
    assert item["answer"] in answer.answer
    cited = [s for s in answer.sources if item["answer"] in s["text"]]
    assert cited and cited[0]["page"] == item["page"], answer.sources
    folder = tmp_path / "docs"
    folder.mkdir()
    for name in ("handbook.pdf", "lighthouse.md"):
        (folder / name).write_bytes((SAMPLES / name).read_bytes())
    library = open_documents(folder, default_model, method="retrieve")
    answer = library.ask(item["question"], max_new_tokens=24)
    cited = [s for s in answer.sources if item["answer"] in s["text"]]
    assert cited, answer.sources
    assert cited[0]["path"] == str(folder / "handbook.pdf") and cited[0]["page"] == item["page"]


def test_cli_ask_prints_sources_and_explains_them(default_model, shared_home):
    """`sekv ask` ends with the sources ([1] p. N "quote"); --show-zoom says in words how much
    of the answer's attention each held and why it was zoomed."""
    item = next(i for i in qa("handbook.pdf") if "Security" in i["question"])
    env = dict(os.environ, SEKV_HOME=str(shared_home))
    doc = str(SAMPLES / "handbook.pdf")
    ask = [sys.executable, "-m", "sekv_cli", "ask", doc, item["question"]]
    proc = subprocess.run(
        [*ask, "--show-zoom"], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    first = lines[lines.index("Sources") + 1]
    assert first.startswith(f'[1] p. {item["page"]}  "') and item["answer"] in first
    assert "of the answer's attention on the document; " in proc.stdout
    assert "picked for the question by" in proc.stdout and "layers while answering" in proc.stdout
    assert "score" not in proc.stdout  # diagnostics only with --verbose


def test_a_chat_follow_up_is_read_after_the_earlier_turn(default_model):
    """A question that refers to the one before ("him") is answered from the conversation."""
    chat = Conversation(Session(default_model, load_document(SAMPLES / "lighthouse.md")))
    first = chat.ask("Who is the principal keeper?", max_new_tokens=24)
    assert "Tobias Wrenfield" in first.answer
    ids = chat.session.question_ids("Who assists him?", chat.turns)
    prompt = default_model.tokenizer.decode(ids)
    assert prompt.index("principal keeper?") < prompt.index(first.answer) < prompt.index("him?")
    second = chat.ask("And who assists him?", max_new_tokens=24)
    assert "Ines Marlow" in second.answer and chat.dropped == 0
    assert second.sources and second.sources[0]["page"] == 1  # over the document only
