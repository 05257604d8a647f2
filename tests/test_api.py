"""The Python API over a collection of tiny documents: routing across stores, citations by file,
a damaged document skipped, an edited file read again (only it), nothing read again between
questions; the README's example as written (tiny random models)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

import sekv_core.api as api
import sekv_core.ingest as ingest
from sekv_core.api import Library, open_documents
from sekv_core.config import MethodSettings
from sekv_core.conversation import Conversation
from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.errors import SekvError
from sekv_core.models import load_model

ROOT = Path(__file__).resolve().parents[1]
TEXTS = {
    "lighthouse.md": "The keeper of the lighthouse is named Orla. She polishes the great lamp "
    "every evening and logs each passing ship in a blue book. ",
    "mill.txt": "The mill grinds corn and barley. The miller, Tomasz, sells flour at the market "
    "on Fridays. The water wheel turns all year. ",
    "reports/harbour.md": "The harbour board counted forty boats at the north pier in spring. "
    "Its budget was 42 thousand crowns. ",
}
KEEPER = "What is the name of the keeper of the lighthouse?"
MILLER = "Who is the miller who sells flour?"
HARBOUR = "How many boats did the harbour board count at the pier?"


@pytest.fixture(scope="module")
def loaded(tiny_model_dirs):
    return load_model(str(tiny_model_dirs["llama"]), device="cpu")


def write(folder: Path, damaged: bool = True) -> Path:
    for name, text in TEXTS.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text * 4)
    if damaged:
        (folder / "broken.txt").write_bytes(b"\x00\x01\x02 not text" * 10)
    return folder


@pytest.fixture
def builds(monkeypatch) -> list[str]:
    """The names of the documents whose stores get built (a document read by the model)."""
    built: list[str] = []
    for name in ("build_store", "build_streamed"):
        real = getattr(ingest, name)

        def counted(path, source, *args, real=real, **kwargs):
            built.append(source.document.path.name)
            return real(path, source, *args, **kwargs)

        monkeypatch.setattr(ingest, name, counted)
    return built


def test_a_question_goes_to_its_documents_and_builds_only_their_stores(tmp_path, loaded, builds):
    docs = write(tmp_path / "docs")
    told: list[str] = []
    library = open_documents(docs, loaded, settings=MethodSettings(warn=told.append))
    assert [Path(d["path"]).name for d in library.documents()] == [
        "lighthouse.md", "mill.txt", "harbour.md",
    ]  # fmt: skip
    assert [s.path.name for s in library.skipped] == ["broken.txt"]
    assert told == [f"skipped: {library.skipped[0].reason}"] and "binary" in told[0]
    assert builds == [] and not any(d["held"] or d["store"] for d in library.documents())

    answer = library.ask(KEEPER, max_new_tokens=6)
    lighthouse = str(docs / "lighthouse.md")
    read = answer.routing["read_together"]
    assert answer.document["path"] == lighthouse == read[0]
    ranked = answer.routing["documents"]
    assert ranked[0]["path"] == lighthouse and ranked[0]["score"] > ranked[1]["score"]
    assert "Orla" in ranked[0]["passage"] and ranked[0]["why"] in ("words", "meaning", "both")
    assert sorted(builds) == sorted(Path(p).name for p in read)  # only the stores it read
    assert answer.sources and {s["path"] for s in answer.sources} <= set(read)
    assert all(s["page"] == 1 for s in answer.sources)
    held = [d["path"] for d in library.documents() if d["held"]]
    assert sorted(held) == sorted(read)
    rows = library.documents()
    mem = answer.memory
    assert mem["collection_resident_bytes"] == sum(
        r["memory"].get("resident_bytes", 0) for r in rows
    )
    assert {"route_s", "first_token_s", "total_s"} <= answer.timings.keys()

    answer = library.ask(HARBOUR, max_new_tokens=6)
    assert answer.document["path"] == str(docs / "reports" / "harbour.md")
    assert {s["path"] for s in answer.sources} <= set(answer.routing["read_together"])
    assert len(builds) == len({*read, *answer.routing["read_together"]})  # each store once


def test_asking_again_reads_nothing_again(tmp_path, loaded, monkeypatch):
    docs = write(tmp_path / "docs", damaged=False)
    library = open_documents(docs, loaded)
    first = library.ask(MILLER, max_new_tokens=6)
    shutil.rmtree(docs)  # the documents are gone: nothing may need them again
    loads: list[str] = []
    real = ingest.load_store
    monkeypatch.setattr(ingest, "load_store", lambda path, *a: loads.append(path) or real(path, *a))
    again = library.ask(MILLER, max_new_tokens=6)
    assert again.answer == first.answer and again.sources == first.sources
    assert loads == [] and again.timings["prepare_s"] == 0


def test_an_edited_document_is_indexed_again_and_only_it(tmp_path, loaded, builds):
    docs = write(tmp_path / "docs", damaged=False)
    opened = open_documents(docs, loaded, build_all=True)
    assert opened.synced.read == 3 and len(builds) == 3
    (docs / "mill.txt").write_text(TEXTS["mill.txt"] * 3 + "The miller retired in May. ")
    (docs / "new.md").write_text("A new note: the ferry leaves at noon. " * 6)
    progress: list[api.IngestProgress] = []
    library = open_documents(docs, loaded, progress=progress.append)
    assert (library.synced.read, library.synced.unchanged) == (2, 2)
    indexing = [p for p in progress if p.unit == "bytes"]
    assert {p.name for p in indexing} == {"mill.txt", "new.md", ""}
    assert indexing[-1].documents_done == indexing[-1].documents == 2
    assert len(builds) == 3  # opening builds no store: a question does
    library.build_stores()
    assert builds[3:] == ["mill.txt", "new.md"]
    hits = {Path(d["path"]).name: d["store"]["cache_hit"] for d in library.documents()}
    assert hits == {"lighthouse.md": True, "mill.txt": False, "new.md": False, "harbour.md": True}


def test_keep_bounds_the_stores_held(tmp_path, loaded):
    docs = write(tmp_path / "docs", damaged=False)
    library = open_documents(docs, loaded, keep=1)
    library.ask(KEEPER, max_new_tokens=4)
    answer = library.ask(MILLER, max_new_tokens=4)
    read = set(answer.routing["read_together"])
    assert {d["path"] for d in library.documents() if d["held"]} == read
    # between answers a store keeps its resident tier: the answer's zoom pools are let go
    assert library.memory()["resident_bytes"] < answer.memory["resident_bytes"]


def test_one_file_is_answered_as_its_session_answers(tmp_path, loaded):
    doc = write(tmp_path / "docs", damaged=False) / "lighthouse.md"
    alone = open_documents(doc, loaded).ask(KEEPER, max_new_tokens=6)
    session = Session(loaded, load_document(doc), "sekv").ask(KEEPER, max_new_tokens=6)
    assert alone.answer == session.answer and alone.document == session.document
    assert [{k: v for k, v in s.items() if k != "path"} for s in alone.sources] == session.sources
    assert all(s["path"] == str(doc) for s in alone.sources)
    assert "documents" not in alone.routing and "route_s" not in alone.timings
    assert set(alone.memory) == set(session.memory)
    with pytest.raises(SekvError, match="binary"):
        open_documents(write(tmp_path / "more") / "broken.txt", loaded)


def test_full_routes_and_retrieve_reads_the_whole_collection(tmp_path, loaded):
    docs = write(tmp_path / "docs", damaged=False)
    full = open_documents(docs, loaded, method="full").ask(MILLER, max_new_tokens=4)
    assert full.method == "full" and Path(full.document["path"]).name == "mill.txt"
    assert full.memory["resident_bytes"] == full.memory["full_kv_bytes"]
    library = open_documents(docs, loaded, method="retrieve")
    whole = library.ask(MILLER, max_new_tokens=4)
    assert whole.method == "retrieve" and whole.document["path"] == str(docs)
    assert whole.document["tokens"] >= sum(d["tokens"] for d in library.documents())
    assert all(d["tokens"] for d in library.documents())  # retrieve reads every document
    assert all(d["store"] is None for d in library.documents())
    assert whole.sources, "retrieve names the passages it read that the answer drew on"
    files = {str(docs / name): load_document(docs / name).text for name in TEXTS}
    for s in whole.sources:  # each placed in its file: its path, page and characters there
        text = files[s["path"]]
        c0, c1 = s["chars"]
        assert s["page"] == 1 and 0 <= c0 < c1 <= len(text)
        assert s["text"].strip("…") in " ".join(text[c0:c1].split())


def test_a_chat_over_a_collection_follows_each_question(tmp_path, loaded):
    docs = write(tmp_path / "docs", damaged=False)
    chat = Conversation(open_documents(docs, loaded))
    first = chat.ask(KEEPER, max_new_tokens=4)
    second = chat.ask(MILLER, max_new_tokens=4)
    paths = [Path(a.document["path"]).name for a in (first, second)]
    assert paths == ["lighthouse.md", "mill.txt"]
    assert len(chat.turns) == 2


def test_documents_over_max_tokens_are_skipped_unless_stored(tmp_path, loaded):
    docs = write(tmp_path / "docs", damaged=False)
    told: list[str] = []
    settings = MethodSettings(warn=told.append)
    library = open_documents(docs, loaded, settings=settings, max_tokens=60)
    library.build_stores()
    assert len(told) == 3 and all("more than --max-tokens 60 allows" in t for t in told)
    assert library.entries == []
    open_documents(docs, loaded, build_all=True)  # every store built: nothing left to refuse
    stored = open_documents(docs, loaded, max_tokens=60)
    stored.build_stores()
    assert stored.skipped == [] and len(stored.entries) == 3


def test_the_readme_example_runs_as_written(loaded, monkeypatch, capsys):
    code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert code, "README shows the Python API in a python block"
    monkeypatch.setattr(api, "load_model", lambda name=None: loaded)  # the tiny model stands in
    monkeypatch.chdir(ROOT)
    names: dict = {}
    exec(compile(code.group(1), "README.md", "exec"), names)
    assert names["answer"].document["path"].startswith("sample_docs/")
    assert capsys.readouterr().out


def test_a_library_is_plain_data_and_a_class(tmp_path, loaded):
    library = open_documents(write(tmp_path / "docs", damaged=False), loaded)
    assert isinstance(library, Library) and library.collection
    assert set(library.memory()) == {
        "documents", "tokens", "resident_bytes", "resident_all_bytes", "full_kv_bytes",
    }  # fmt: skip


@pytest.mark.integration
def test_the_default_model_answers_across_the_sample_documents(default_model):
    """The real model over a collection: each question goes to its document and the answer
    cites it by file and page."""
    docs = [ROOT / "sample_docs" / "lighthouse.md", ROOT / "sample_docs" / "handbook.pdf"]
    library = open_documents(docs, default_model)
    answer = library.ask("Who is the head of the Security team?", max_new_tokens=24)
    assert answer.document["path"] == str(docs[1]) and "Marta Quill" in answer.answer
    assert any(
        s["path"] == str(docs[1]) and s["page"] == 5 and "Marta Quill" in s["text"]
        for s in answer.sources
    )
    answer = library.ask("What is the station dog called?", max_new_tokens=16)
    assert answer.document["path"] == str(docs[0])
    assert any("Biscuit" in s["text"] for s in answer.sources)


def test_the_model_reads_passages_again_only_where_it_picks_what_is_read(tmp_path, loaded):
    few = write(tmp_path / "few", damaged=False)  # three documents: all are read together
    many = write(tmp_path / "many", damaged=False)
    (many / "ferry.md").write_text("The ferry to Holm leaves the quay at seven each morning. " * 4)
    with open_documents(few, loaded) as library:
        assert all(r.model is None for r in library.rank(KEEPER))
    with open_documents(many, loaded) as library:
        ranked = library.rank(KEEPER)
        assert len(ranked) == 4 and ranked[0].model is not None
        assert [r.score for r in ranked] == sorted((r.score for r in ranked), reverse=True)
    with open_documents(many, loaded, method="full") as library:  # one read: the model picks
        assert library.rank(KEEPER)[0].model is not None
    with open_documents(many, loaded, method="retrieve") as library:  # all read: it picks none
        assert all(r.model is None for r in library.rank(KEEPER))
