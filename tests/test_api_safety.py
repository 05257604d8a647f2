"""The Python API is safe to build on: threads on one library and on libraries sharing a
model answer as one thread would; a file edited under a library is read again, said once;
misused arguments raise TypeError or ValueError naming them before any work; a closed
library lets go of its stores and refuses questions (tiny random models, the real kernels)."""

from __future__ import annotations

import gc
import os
import threading
import weakref
from pathlib import Path

import pytest

import sekv_core.api as api
from sekv_core.api import AskOptions, open_documents
from sekv_core.config import MethodSettings
from sekv_core.conversation import Conversation
from sekv_core.models import load_model
from sekv_core.sampling import Sampling

KEEPER = "What is the name of the keeper of the lighthouse?"
MILLER = "Who is the miller who sells flour?"
LIGHTHOUSE = "The keeper of the lighthouse is named Orla. She polishes the great lamp. " * 6
MILL = "The mill grinds corn and barley. The miller, Tomasz, sells flour on Fridays. " * 6
WAIT = 2.0  # seconds a thread waits for another to be mid-answer (with the lock: in vain)


@pytest.fixture(scope="module")
def loaded(tiny_model_dirs):
    return load_model(str(tiny_model_dirs["llama"]), device="cpu")


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def edit(path: Path, text: str) -> None:
    """Write ``text`` over ``path`` with a later time (a coarse clock cannot hide it)."""
    before = path.stat().st_mtime_ns
    path.write_text(text)
    os.utime(path, ns=(before + 10**9, before + 10**9))


def test_two_libraries_on_one_model_answer_alone_when_asked_at_once(tmp_path, loaded):
    """Library ``b`` starts its answer while ``a`` is in the middle of one, and ``a`` ends
    first. Without one lock per model, ``a``'s end switched the model's attention back to
    its own while ``b`` decoded: ``b`` answered wrongly and nothing said so."""
    a = open_documents(write(tmp_path / "lighthouse.md", LIGHTHOUSE), loaded)
    b = open_documents(write(tmp_path / "mill.txt", MILL), loaded)
    alone = {"a": a.ask(KEEPER, 8).answer, "b": b.ask(MILLER, 24).answer}
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    got: dict[str, str] = {}

    def a_text(_: str) -> None:  # a's first text: wait for b to be answering too
        if not a_in.is_set():
            a_in.set()
            b_in.wait(WAIT)

    def b_text(_: str) -> None:  # b's first text: wait for a to be done
        if not b_in.is_set():
            b_in.set()
            a_done.wait(WAIT)

    def ask_a() -> None:
        got["a"] = a.ask(KEEPER, 8, on_text=a_text).answer
        a_done.set()

    def ask_b() -> None:
        a_in.wait(WAIT)
        got["b"] = b.ask(MILLER, 24, on_text=b_text).answer

    threads = [threading.Thread(target=ask_a), threading.Thread(target=ask_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert a_in.is_set() and b_in.is_set()  # both answers streamed text
    assert got == alone


def test_threads_on_a_library_and_on_two_sharing_a_model_answer_as_one(tmp_path, loaded):
    """4 threads asking one library twice each, with 2 more on a second library over the same
    model: every answer (greedy) is the one a single thread gets."""
    docs = write(tmp_path / "docs" / "lighthouse.md", LIGHTHOUSE).parent
    write(docs / "mill.txt", MILL)
    one = open_documents(docs, loaded)
    other = open_documents(docs / "mill.txt", loaded)
    questions = [KEEPER, MILLER, "What does she polish?", "When is flour sold?"]
    work = [(one, q) for q in questions] + [(other, q) for q in questions[:2]]
    alone = {(id(lib), q): lib.ask(q, 12).answer for lib, q in work}
    got: dict[tuple[int, str], list[str]] = {}
    errors: list[BaseException] = []

    def ask(lib: api.Library, question: str) -> None:
        try:
            for _ in range(2):
                answer = lib.ask(question, 12).answer
                got.setdefault((id(lib), question), []).append(answer)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=w) for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert got == {key: [answer, answer] for key, answer in alone.items()}


def test_a_file_edited_under_a_library_is_read_again_and_said_once(tmp_path, loaded):
    doc = write(tmp_path / "lighthouse.md", LIGHTHOUSE)
    told: list[str] = []
    library = open_documents(doc, loaded, settings=MethodSettings(warn=told.append))
    chat = Conversation(library)
    first = chat.ask(KEEPER, 6)
    os.utime(doc, ns=(doc.stat().st_mtime_ns + 10**9,) * 2)  # touched: the same bytes
    assert chat.ask(KEEPER, 6).document == first.document and told == []
    edit(doc, LIGHTHOUSE.replace("Orla", "Brigid"))
    chat.reset()
    again = chat.ask(KEEPER, 6)
    assert told == ["lighthouse.md changed on disk; reading it again"]
    assert again.document["sha256"] != first.document["sha256"]
    assert "Brigid" in library.answered.document.text
    assert library.documents()[0]["sha256"] == again.document["sha256"]
    library.ask(KEEPER, 6)
    assert len(told) == 1  # read once


def test_a_collection_file_edited_is_indexed_and_read_again(tmp_path, loaded):
    docs = write(tmp_path / "docs" / "lighthouse.md", LIGHTHOUSE).parent
    mill = write(docs / "mill.txt", MILL)
    told: list[str] = []
    library = open_documents(docs, loaded, settings=MethodSettings(warn=told.append))

    def hashes() -> dict[str, str]:
        return {Path(d["path"]).name: d["sha256"] for d in library.documents()}

    library.ask(MILLER, 6)
    before = hashes()
    edit(mill, MILL.replace("Tomasz", "Wendel"))
    after = library.ask(MILLER, 6)
    assert told == ["mill.txt changed on disk; reading it again"]
    assert hashes()["mill.txt"] != before["mill.txt"]
    assert hashes()["lighthouse.md"] == before["lighthouse.md"]
    assert "Wendel" in after.routing["documents"][0]["passage"]  # the index read it again
    assert "Wendel" in library.answered.document.text


def test_an_edited_file_that_cannot_be_read_now_is_an_error_each_time(tmp_path, loaded):
    doc = write(tmp_path / "lighthouse.md", LIGHTHOUSE)
    library = open_documents(doc, loaded, settings=MethodSettings(warn=lambda m: None))
    library.ask(KEEPER, 4)
    edit(doc, "   ")
    for _ in range(2):  # never the old text
        with pytest.raises(api.SekvError, match="empty"):
            library.ask(KEEPER, 4)


@pytest.fixture
def nothing_read(monkeypatch):
    """Fail when a document would be read or a model loaded."""
    monkeypatch.setattr(api, "select_documents", lambda *a: pytest.fail("documents read"))
    monkeypatch.setattr(api, "load_model", lambda *a: pytest.fail("model loaded"))


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"paths": None}, TypeError, "paths"),
        ({"paths": 42}, TypeError, "paths"),
        ({"paths": ""}, ValueError, "empty path"),
        ({"model": 3}, TypeError, "model"),
        ({"method": "nope"}, ValueError, "method"),
        ({"max_tokens": -5}, ValueError, "max_tokens"),
        ({"max_tokens": 2.5}, TypeError, "max_tokens"),
        ({"keep": 0}, ValueError, "keep"),
        ({"progress": "loud"}, TypeError, "progress"),
        ({"settings": {"budget": 8}}, TypeError, "settings"),
        ({"settings": MethodSettings(budget=0)}, ValueError, "settings.budget"),
        ({"settings": MethodSettings(memory_share=1.5)}, ValueError, "settings.memory_share"),
        ({"settings": MethodSettings(memory_share=0.0)}, ValueError, "settings.memory_share"),
        ({"settings": MethodSettings(margin=-1.0)}, ValueError, "settings.margin"),
        ({"settings": MethodSettings(neighbours=-1)}, ValueError, "settings.neighbours"),
    ],
)
def test_open_documents_misuse_is_named_before_any_work(kwargs, error, named, nothing_read):
    kwargs = {"paths": "notes.md", **kwargs}
    with pytest.raises(error, match=named.replace(".", r"\.")):
        open_documents(**kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "named"),
    [
        ((None,), {}, TypeError, "question"),
        ((42,), {}, TypeError, "question"),
        (("  ",), {}, ValueError, "question"),
        ((KEEPER,), {"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ((KEEPER,), {"max_new_tokens": -3}, ValueError, "max_new_tokens"),
        ((KEEPER,), {"max_new_tokens": True}, TypeError, "max_new_tokens"),
        ((KEEPER,), {"sampling": 0.7}, TypeError, "sampling"),
        ((KEEPER,), {"stop": "."}, TypeError, "stop"),
        ((KEEPER,), {"on_text": "print"}, TypeError, "on_text"),
        ((KEEPER,), {"budget": 8}, TypeError, "budget"),
    ],
)
def test_ask_misuse_is_named_before_any_work(tmp_path, loaded, args, kwargs, error, named):
    library = open_documents(write(tmp_path / "lighthouse.md", LIGHTHOUSE), loaded)
    library.read_changed = lambda: pytest.fail("work done")
    with pytest.raises(error, match=named):
        library.ask(*args, **kwargs)
    with pytest.raises(error, match=named):  # before a chat measures the window
        Conversation(library).ask(*args, **kwargs)


def test_options_made_once_answer_as_keywords_do(tmp_path, loaded):
    library = open_documents(write(tmp_path / "lighthouse.md", LIGHTHOUSE), loaded)
    options = AskOptions(4, stop=("\n",))
    assert library.answer(KEEPER, options).answer == library.ask(KEEPER, 4, stop=["\n"]).answer
    with pytest.raises(TypeError, match="max_new_tokens"):  # checked where they are made
        AskOptions(max_new_tokens=2.5)


def test_a_chat_reads_its_own_turns_not_a_history_given(tmp_path, loaded):
    library = open_documents(write(tmp_path / "lighthouse.md", LIGHTHOUSE), loaded)
    library.read_changed = lambda: pytest.fail("work done")
    with pytest.raises(ValueError, match="history"):
        Conversation(library).ask(KEEPER, history=[("Who?", "Orla.")])


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")],
)
def test_sampling_out_of_range_is_a_value_error(kwargs, named):
    with pytest.raises(ValueError, match=named):
        Sampling(**kwargs)


def test_a_closed_library_lets_go_and_refuses_questions(tmp_path, loaded):
    docs = write(tmp_path / "docs" / "lighthouse.md", LIGHTHOUSE).parent
    write(docs / "mill.txt", MILL)
    with open_documents(docs, loaded) as library:
        library.ask(KEEPER, 4)
        held = [weakref.ref(s.method) for s in library.sessions.values()]
        assert held and library.memory()["resident_bytes"] > 0
    assert library.closed and library.catalog is None
    gc.collect()
    assert all(ref() is None for ref in held)  # the stores and their memory are gone
    assert library.memory()["resident_bytes"] == 0
    for call in (lambda: library.ask(KEEPER), lambda: library.room(KEEPER)):
        with pytest.raises(ValueError, match="closed"):
            call()
    library.close()  # again: nothing happens


@pytest.mark.integration
def test_the_default_model_answers_threads_as_one(default_model, shared_home, monkeypatch):
    """The real model and kernels: 3 threads asking one library of the sample lighthouse
    twice each, while a second library shares the model: the single-threaded answers."""
    monkeypatch.setenv("SEKV_HOME", str(shared_home))  # the store other tests build
    doc = Path(__file__).resolve().parents[1] / "sample_docs" / "lighthouse.md"
    one, other = open_documents(doc, default_model), open_documents(doc, default_model)
    questions = [
        "What is the station dog called?",
        "Who is the principal keeper?",
        "What is the fog signal called?",
    ]
    work = [(one, q) for q in questions] + [(other, questions[0])]
    alone = {(id(lib), q): lib.ask(q, 12).answer for lib, q in work}
    assert "Biscuit" in alone[(id(one), questions[0])]
    got: dict[tuple[int, str], list[str]] = {}

    def ask(lib: api.Library, question: str) -> None:
        for _ in range(2):
            got.setdefault((id(lib), question), []).append(lib.ask(question, 12).answer)

    threads = [threading.Thread(target=ask, args=w) for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {key: [answer, answer] for key, answer in alone.items()}
