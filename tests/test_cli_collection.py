"""`sekv ask|chat|ingest PATH...` over a collection: JSON with documents[] and each source's
file, the API's answer, skipped documents, one store read per changed file, the HTML view
(tiny random models)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sekv_cli.main import app
from sekv_core.api import open_documents
from sekv_core.config import MethodSettings
from sekv_core.models import load_model

runner = CliRunner()
TEXTS = {
    "lighthouse.md": "The keeper of the lighthouse is named Orla. She polishes the great lamp. ",
    "mill.txt": "The mill grinds corn. The miller, Tomasz, sells flour at the market. ",
    "reports/harbour.md": "The harbour board counted forty boats at the north pier. ",
}
MILLER = "Who is the miller who sells flour?"


def run(*args, input: str | None = None):
    return runner.invoke(app, [str(a) for a in args], input=input, env={"COLUMNS": "1000"})


@pytest.fixture
def docs(tmp_path) -> Path:
    root = tmp_path / "docs"
    for name, text in TEXTS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text * 4)
    (root / "broken.txt").write_bytes(b"\x00\x01 not text" * 10)
    return root


@pytest.fixture
def model(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["llama"])


def test_ask_json_over_a_folder_is_the_api_answer_with_its_documents(docs, model):
    result = run("ask", docs, MILLER, "--json", "--model", model, "--max-new-tokens", "5")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    mill = str(docs / "mill.txt")
    assert data["document"]["path"] == mill and data["routing"]["documents"][0]["path"] == mill
    assert {s["path"] for s in data["sources"]} <= set(data["routing"]["read_together"])
    assert [Path(d["path"]).name for d in data["documents"]] == [
        "lighthouse.md", "mill.txt", "harbour.md",
    ]  # fmt: skip
    for d in data["documents"]:
        assert {"path", "sha256", "tokens", "pages", "store", "memory", "held"} <= d.keys()
        if d["held"]:  # read for the answer: its store built now
            assert d["store"]["cache_hit"] is False and Path(d["store"]["path"]).is_dir()
        else:  # never read: no store
            assert d["store"] is None and d["tokens"] is None
    assert [Path(s["path"]).name for s in data["skipped"]] == ["broken.txt"]
    assert data["in_all"]["documents"] == 3
    assert data["store"]["cache_hit"] is False  # built when the question was routed to it
    stderr = result.stderr.splitlines()
    assert stderr[0].startswith("Warning: skipped: cannot read '") and "broken.txt" in stderr[0]
    assert stderr[-1].startswith("3 documents (4 files indexed now, 0 unchanged); 1 of 4 skipped")

    loaded = load_model(model, device="cpu")
    settings = MethodSettings(warn=lambda message: None)
    api = open_documents(docs, loaded, settings=settings).ask(MILLER, max_new_tokens=5)
    assert api.answer == data["answer"] and api.sources == data["sources"]
    assert api.document == data["document"] and api.zoom == data["zoom"]


def test_plain_answer_names_each_source_file(docs, model):
    result = run("ask", docs / "mill.txt", docs / "lighthouse.md", MILLER, "--model", model,
                 "--max-new-tokens", "4", "--show-zoom")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f'\n[1] {docs / "mill.txt"} p. 1  "' in result.stdout
    assert f"* {docs / 'mill.txt'} " in result.stdout
    assert "stores held: resident" in result.stdout


def test_a_single_file_keeps_its_json(docs, model):
    result = run("ask", docs / "mill.txt", MILLER, "--json", "--model", model,
                 "--max-new-tokens", "4")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert not {"documents", "skipped", "in_all"} & data.keys()
    assert "documents" not in data["routing"] and "route_s" not in data["timings"]
    assert result.stderr == ""


def test_ingest_reads_only_new_and_changed_documents(docs, model):
    first = run("ingest", docs, "--model", model, "--json")
    assert first.exit_code == 0, first.output
    data = json.loads(first.stdout)
    assert [d["store"]["cache_hit"] for d in data["documents"]] == [False] * 3
    assert len(data["skipped"]) == 1 and data["in_all"]["documents"] == 3
    (docs / "mill.txt").write_text(TEXTS["mill.txt"] * 5)
    again = run("ingest", docs, "--model", model)
    assert again.exit_code == 0, again.output
    rows = {line.split()[0]: line for line in again.stdout.splitlines() if line.strip()}
    assert "built" in rows[str(docs / "mill.txt")]
    assert "cache hit" in rows[str(docs / "lighthouse.md")]
    assert "(1 file indexed now, 3 unchanged); stores: 1 read now, 2 found" in again.stderr


def test_chat_over_a_folder_goes_where_each_question_goes(docs, model):
    questions = "Who keeps the lighthouse?\nHow many boats did the harbour board count?\n"
    result = run("chat", docs, "--model", model, "--max-new-tokens", "3", input=questions)
    assert result.exit_code == 0, result.output
    assert "3 documents: " in result.stderr
    answers = result.stdout.split("> ")[1:]  # each question's answer and sources
    assert len(answers) == 2 and all(f"\n[1] {docs}/" in a for a in answers)


def test_html_over_a_collection_lists_its_documents(docs, model, tmp_path):
    out = tmp_path / "answer.html"
    result = run("ask", docs, MILLER, "--model", model, "--max-new-tokens", "4",
                 "--html", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert "<h2>Documents</h2>" in page and "(answered from)" in page
    assert page.count('<td class="path">') == 3
    assert f'<div class="file">{docs / "mill.txt"}</div>' in page
    assert 'id="document"' in page


def test_a_file_whose_name_is_not_utf8_is_read_and_cited(docs, model):
    """A name of bytes that are not UTF-8: indexed, answered from, cited (its name printed
    with the odd byte escaped); the next question finds it unchanged."""
    with open(os.path.join(os.fsencode(docs), b"r\xe9port.md"), "w") as f:
        f.write("The report names the miller Tomasz, who sells flour at the market. " * 4)
    ask = ("ask", docs, MILLER, "--json", "--model", model, "--max-new-tokens", "4")
    result = run(*ask)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert str(docs / "r\\xe9port.md") in [d["path"] for d in data["documents"]]
    assert "4 documents (5 files indexed now" in result.stderr
    again = run(*ask)
    assert again.exit_code == 0 and "(0 files indexed now, 5 unchanged)" in again.stderr


def test_an_empty_or_unreadable_selection_is_an_error(tmp_path, model):
    (tmp_path / "empty").mkdir()
    result = run("ask", tmp_path / "empty", "q", "--model", model)
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: no documents in '") and result.stdout == ""
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.txt").write_bytes(b"\x00")
    result = run("ingest", tmp_path / "bad", "--model", model)
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == "Error: the only document in " + (
        f"'{tmp_path / 'bad'}' could not be read"
    )
    (tmp_path / "bad" / "y.md").write_bytes(b"\x00")
    result = run("ingest", tmp_path / "bad", "--model", model)
    assert result.stderr.splitlines()[-1] == "Error: none of the 2 documents in " + (
        f"'{tmp_path / 'bad'}' could be read"
    )


def test_a_folder_that_holds_sekv_home_reads_only_the_documents(docs, model, monkeypatch):
    """$SEKV_HOME inside the folder asked (its stores, models, index) is never read as
    documents; it and the hidden files left out are said on the opened line."""
    home = docs / "sekv-cache"
    monkeypatch.setenv("SEKV_HOME", str(home))
    (home / "models" / "card").mkdir(parents=True)
    (home / "models" / "card" / "README.md").write_text("A model card. " * 20)
    (docs / ".draft.md").write_text("A hidden draft. " * 20)
    for _ in range(2):  # the second time, over the stores the first wrote into $SEKV_HOME
        result = run("ask", docs, MILLER, "--json", "--model", model, "--max-new-tokens", "3")
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert sorted(Path(d["path"]).name for d in data["documents"]) == [
            "harbour.md", "lighthouse.md", "mill.txt",
        ]  # fmt: skip
        assert result.stderr.splitlines()[-1].endswith(
            "; 1 of 4 skipped (unreadable, see above); 1 hidden file and $SEKV_HOME skipped"
        )
    assert any((home / "stores").iterdir())


def test_a_read_only_home_answers_from_its_stores_and_writes_nothing(
    docs, model, sekv_home, read_only_home
):
    """$SEKV_HOME a shared cache mounted read-only that holds the stores and the index: a
    file and the folder are answered from them, and nothing there is written (no lock file,
    no last use, no index write); a document it holds no store of is one error line."""
    from conftest import home_files

    (docs / "broken.txt").unlink()
    quiet = MethodSettings(warn=lambda message: None)
    with open_documents(docs, load_model(model, device="cpu"), settings=quiet, build_all=True):
        pass  # the stores and the index, closed (as `sekv ingest` leaves them when it exits)
    before = read_only_home()
    for path in (docs / "mill.txt", docs):
        result = run("ask", path, MILLER, "--json", "--model", model, "--max-new-tokens", "3")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["store"]["cache_hit"] is True
    assert home_files(sekv_home) == before
    (docs / "new.md").write_text("The ferry leaves at seven. " * 4)
    for path, says in ((docs / "new.md", "it holds no span store of new.md"),
                       (docs, "the collection index there cannot record 1 new")):  # fmt: skip
        result = run("ask", path, MILLER, "--model", model)
        assert result.exit_code == 1 and result.stdout == ""
        assert result.stderr.startswith(f"Error: $SEKV_HOME {sekv_home} is read-only: {says}")
        assert len(result.stderr.splitlines()) == 1
    assert home_files(sekv_home) == before
