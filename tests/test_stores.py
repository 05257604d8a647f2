"""`sekv stores`: list, rm and prune real stores built by the CLI from a tiny model."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sekv_cli.main import app
from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.locks import store_lock
from sekv_core.models import load_model
from sekv_core.store import shelf

runner = CliRunner()
DAY = 86400.0


def run(*args, home=None):
    env = {"SEKV_HOME": str(home)} if home else None
    return runner.invoke(app, [str(a) for a in args], env=env)


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_model_dirs):
    """A home with three stores: two documents' span stores and a block store of the first."""
    root = tmp_path_factory.mktemp("stores")
    home = root / "home"
    docs = {"a": root / "notes [bold]a.md", "b": root / "b.txt"}
    docs["a"].write_text(" ".join(f"Gate {i} opens at {i % 24}:00." for i in range(30)))
    docs["b"].write_text(" ".join(f"Shelf {i} holds {i * 3} jars." for i in range(30)))
    model = tiny_model_dirs["llama"]
    for doc in docs.values():
        result = run("ingest", doc, "--model", model, home=home)
        assert result.exit_code == 0, result.output
    with pytest.MonkeyPatch.context() as env:  # blocks: a benchmark method, not `sekv ask`'s
        env.setenv("SEKV_HOME", str(home))
        Session(load_model(str(model)), load_document(docs["a"]), "blocks")
    return home, docs, model


@pytest.fixture
def home(built, sekv_home):
    shutil.copytree(built[0], sekv_home)
    return sekv_home


def listed() -> list[dict]:
    result = run("stores", "list", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["stores"]


def by_kind(stores: list[dict], docs) -> dict[str, dict]:
    """The stores by name: "a", "b" (span stores) and "blocks-a"."""
    names = {str(p): k for k, p in docs.items()}
    return {("blocks-" if s["kind"] == "blocks" else "") + names[s["document"]]: s for s in stores}


def test_list_shows_every_store(home, built):
    _, docs, model = built
    stores = listed()
    assert len(stores) == 3
    named = by_kind(stores, docs)
    assert set(named) == {"a", "b", "blocks-a"}
    for s in stores:
        assert s["model"] == str(model) and s["tokens"] > 0 and s["bytes"] > 0
        assert s["path"] == str(home / "stores" / s["key"]) and s["last_used"].endswith("Z")
    assert named["blocks-a"]["key"].startswith("blocks-")
    assert named["blocks-a"]["sha256"] == named["a"]["sha256"]
    plain = run("stores", "list")
    assert plain.exit_code == 0
    assert "[bold]a.md" in plain.stdout  # a file name is text, never markup
    assert "3 stores" in plain.stdout


def test_rm_by_file_removes_its_stores_for_every_model(home, built):
    _, docs, _ = built
    result = run("stores", "rm", docs["a"])
    assert result.exit_code == 0, result.output
    assert "Removed 2 stores" in result.stdout
    assert [s["document"] for s in listed()] == [str(docs["b"])]
    assert not any(p.name.startswith(".trash-") for p in (home / "stores").iterdir())


def test_rm_by_key_prefix_removes_that_store_only(home, built):
    _, docs, _ = built
    named = by_kind(listed(), docs)
    result = run("stores", "rm", named["b"]["key"][:16], "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [s["key"] for s in data["removed"]] == [named["b"]["key"]]
    assert data["bytes"] == named["b"]["bytes"] and data["busy"] == []
    assert set(by_kind(listed(), docs)) == {"a", "blocks-a"}


def mark(stores: dict[str, dict], **days_ago: float) -> None:
    now = time.time()
    for name, days in days_ago.items():
        shelf.mark_used(Path(stores[name]["path"]), now - days * DAY)


def test_prune_older_than_removes_old_stores_and_keeps_fresh_ones(home, built):
    _, docs, _ = built
    named = by_kind(listed(), docs)
    mark(named, a=40, b=0, **{"blocks-a": 29})
    result = run("stores", "prune", "--older-than", "30d")
    assert result.exit_code == 0, result.output
    assert {s["key"] for s in listed()} == {named["b"]["key"], named["blocks-a"]["key"]}


def test_prune_max_size_keeps_the_most_recently_used(home, built):
    _, docs, _ = built
    named = by_kind(listed(), docs)
    mark(named, a=1, b=3, **{"blocks-a": 2})
    limit = named["a"]["bytes"] + named["blocks-a"]["bytes"]
    dry = run("stores", "prune", "--max-size", str(limit), "--dry-run")
    assert dry.exit_code == 0 and "Would remove" in dry.stdout and len(listed()) == 3
    result = run("stores", "prune", "--max-size", str(limit), "--json")
    assert result.exit_code == 0, result.output
    assert [s["key"] for s in json.loads(result.stdout)["removed"]] == [named["b"]["key"]]
    assert set(by_kind(listed(), docs)) == {"a", "blocks-a"}
    assert run("stores", "prune", "--max-size", "0").exit_code == 0
    assert listed() == []


def test_loading_a_store_records_its_use_and_a_live_session_survives_its_removal(home, built):
    from sekv_core.documents import load_document
    from sekv_core.engine import Session
    from sekv_core.models import load_model

    _, docs, model = built
    path = Path(by_kind(listed(), docs)["a"]["path"])
    shelf.mark_used(path, time.time() - 40 * DAY)
    session = Session(load_model(str(model), device="cpu"), load_document(docs["a"]), "sekv")
    assert session.method.cache_hit and time.time() - path.stat().st_mtime < DAY
    first = session.ask("Which gate opens at noon?", max_new_tokens=6)
    assert first.routing["zoomed_tokens_max"] > 0  # the answer read the offload tier
    result = run("stores", "rm", docs["a"])
    assert result.exit_code == 0 and not path.exists()
    again = session.ask("Which gate opens at noon?", max_new_tokens=6)
    assert again.answer == first.answer and again.zoom == first.zoom


def test_a_store_being_built_is_kept(home, built):
    _, docs, _ = built
    named = by_kind(listed(), docs)
    with store_lock(home / "stores" / named["b"]["key"]):  # a builder holds it
        result = run("stores", "rm", named["b"]["key"])
        pruned = run("stores", "prune", "--max-size", "0")
    assert result.exit_code == 1 and result.stderr.startswith("Error: ")
    assert "being built" in result.stderr and len(result.stderr.splitlines()) == 1
    assert pruned.exit_code == 0 and "Warning: kept" in pruned.stderr
    assert [s["key"] for s in listed()] == [named["b"]["key"]]


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["rm", "nosuchkey"], 1, "no store matches 'nosuchkey'"),
        (["rm", "nowhere.pdf"], 1, "no store matches"),
        (["prune", "--max-size", "2X"], 2, "not a size"),
        (["prune", "--older-than", "30"], 2, "not an age"),
    ],
)
def test_errors(args, code, message):
    result = run("stores", *args)
    assert result.exit_code == code, result.output
    assert message in result.stderr
    if code == 1:
        assert result.stderr.startswith("Error: ") and len(result.stderr.splitlines()) == 1


def test_sizes_and_ages_parse():
    assert shelf.parse_size("2G") == 2 << 30 and shelf.parse_size("500MB") == 500 << 20
    assert shelf.parse_size("1.5GiB") == 3 << 29 and shelf.parse_size("1024") == 1024
    assert shelf.parse_age("30d") == 30 * DAY and shelf.parse_age("12h") == 12 * 3600
    for bad in ("", "G", "-1G", "2 X"):
        with pytest.raises(ValueError):
            shelf.parse_size(bad)


def test_stores_commands_need_no_torch(home):
    from test_startup import run_light

    env = {"SEKV_HOME": str(home)}
    res = run_light(
        [
            (["stores", "-h"], env),
            (["stores", "list", "--json"], env),
            (["stores", "rm", "nosuchkey"], env),
            (["stores", "prune", "--older-than", "1w"], env),
        ]
    )
    assert res[0]["code"] == 0 and "prune" in res[0]["stdout"]
    assert res[1]["code"] == 0 and len(json.loads(res[1]["stdout"])["stores"]) == 3
    assert res[2]["code"] == 1 and res[3]["code"] == 0


def test_interrupted_ingests_and_leftovers_are_listed_and_removed(home):
    """An interrupted ingest's work folder is listed as such (a rerun resumes it) and a dead
    writer's leftovers as leftovers; `prune` alone removes only the leftovers, `rm` of the
    document removes its interrupted ingest too."""
    import os

    from sekv_core.locks import STATE_VERSION

    stores = home / "stores"
    key = next(s["key"] for s in listed() if s["kind"] == "span")
    missing = key[:-4] + "0000"  # a store of the same document not built yet
    partial = stores / f".partial-{missing}"
    partial.mkdir()
    (partial / "state-1.safetensors").write_bytes(b"x" * 1000)
    record = {"version": STATE_VERSION, "store": missing, "parts": []}
    record["tensors"] = {"name": "state-1.safetensors", "sha256": "0"}
    (partial / "state.json").write_text(json.dumps(record))
    trash = stores / f".trash-{key}-99999999"  # a dead process's
    trash.mkdir()
    (trash / "offload.safetensors").write_bytes(b"y" * 5000)
    stale = stores / f".tmp-{key}-abc"  # an unmarked half-written store, long abandoned
    stale.mkdir()
    os.utime(stale, (time.time() - 2 * DAY, time.time() - 2 * DAY))
    kinds = {s["path"]: s["kind"] for s in listed()}
    assert kinds[str(partial)] == "resumable"
    assert kinds[str(trash)] == kinds[str(stale)] == "leftover"
    shown = run("stores", "list")
    assert "3 interrupted or leftover work folders" in shown.stdout
    dry = run("stores", "prune", "--dry-run")
    assert dry.exit_code == 0 and "Would remove 2 leftover work folders, " in dry.stdout
    assert trash.exists() and stale.exists()
    pruned = run("stores", "prune", "--json")
    assert pruned.exit_code == 0, pruned.output
    assert {e["kind"] for e in json.loads(pruned.stdout)["removed"]} == {"leftover"}
    assert not trash.exists() and not stale.exists() and partial.exists()
    document = next(s["document"] for s in listed() if s["key"] == key)
    removed = run("stores", "rm", document, "--json")
    assert removed.exit_code == 0, removed.output
    assert not partial.exists() and str(partial) in {
        e["path"] for e in json.loads(removed.stdout)["removed"]
    }


def test_an_interrupted_ingest_is_listed_by_its_document_and_one_store_is_singular(home):
    """The checkpoint of a streamed build names its document (no store of that document
    exists to name it); a count of one reads singular."""
    from sekv_core.locks import STATE_VERSION

    stores = home / "stores"
    for key in [s["key"] for s in listed()][1:]:
        assert run("stores", "rm", key).exit_code == 0
    partial = stores / f".partial-{'9' * 12}-abc"  # a document no store was built for
    partial.mkdir()
    (partial / "state-1.safetensors").write_bytes(b"x" * 1000)
    record = {"version": STATE_VERSION, "store": partial.name.removeprefix(".partial-")}
    record.update(document="/books/atlas.md", parts=[])
    record["tensors"] = {"name": "state-1.safetensors", "sha256": "0"}
    (partial / "state.json").write_text(json.dumps(record))
    (entry,) = [s for s in listed() if s["kind"] == "resumable"]
    assert entry["document"] == "/books/atlas.md"
    shown = run("stores", "list").stdout
    assert "atlas.md (interrupted ingest)" in shown
    assert "1 store and 1 interrupted or leftover work folder, " in shown
    removed = run("stores", "rm", entry["key"])
    assert "Removed 1 interrupted ingest, " in removed.stdout
    assert "interrupted ingest of /books/atlas.md" in removed.stdout


def test_rm_of_a_file_from_another_folder_removes_that_file_stores_only(
    tmp_path, tiny_model_dirs, sekv_home, monkeypatch
):
    """Two files of one name in two folders, each ingested by its relative path from its
    folder: `rm NAME` removes the stores of the file NAME names from where it runs, never
    the other's; a store an older sekv recorded under the relative path is matched by the
    file's content only."""
    model = tiny_model_dirs["llama"]
    keys = {}
    for folder, text in (
        ("one", "Gate {i} opens at {i}:00."),
        ("two", "Shelf {i} holds {i} jars."),
    ):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "notes.md").write_text(" ".join(text.format(i=i) for i in range(30)))
        monkeypatch.chdir(tmp_path / folder)
        result = run("ingest", "notes.md", "--model", model)
        assert result.exit_code == 0, result.output
        keys[folder] = Path(json.loads(run("ingest", "notes.md", "--model", model, "--json")
                                       .stdout)["store"]["path"]).name  # fmt: skip
    recorded = {s["key"]: s["document"] for s in listed()}
    assert recorded == {keys[f]: str(tmp_path / f / "notes.md") for f in keys}  # absolute
    manifest = sekv_home / "stores" / keys["one"] / "manifest.json"
    old = json.loads(manifest.read_text())
    old["document"]["path"] = "notes.md"  # as an older sekv recorded it: relative
    manifest.write_text(json.dumps(old))
    result = run("stores", "rm", "notes.md", "--json")  # from folder two
    assert result.exit_code == 0, result.output
    assert [e["key"] for e in json.loads(result.stdout)["removed"]] == [keys["two"]]
    assert [s["key"] for s in listed()] == [keys["one"]]
    monkeypatch.chdir(tmp_path)
    assert run("stores", "rm", "two/notes.md").exit_code == 1  # its store is gone already
    result = run("stores", "rm", "one/notes.md", "--json")  # matched by content
    assert result.exit_code == 0, result.output
    assert [e["key"] for e in json.loads(result.stdout)["removed"]] == [keys["one"]]


def test_rm_of_a_deleted_file_matches_its_absolute_path(home, built, monkeypatch):
    _, docs, _ = built
    key = by_kind(listed(), docs)["b"]["key"]
    gone = home.parent / "gone" / "b.txt"  # where b's store says b was: deleted since
    gone.parent.mkdir()
    manifest = home / "stores" / key / "manifest.json"
    recorded = json.loads(manifest.read_text())
    recorded["document"]["path"] = str(gone)
    manifest.write_text(json.dumps(recorded))
    monkeypatch.chdir(gone.parent.parent)
    assert run("stores", "rm", "b.txt").exit_code == 1  # here, b.txt names no store
    result = run("stores", "rm", "gone/b.txt", "--json")
    assert result.exit_code == 0, result.output
    assert [e["key"] for e in json.loads(result.stdout)["removed"]] == [key]


def test_an_ambiguous_key_prefix_is_an_error_that_removes_nothing(home, built):
    _, docs, _ = built
    key = by_kind(listed(), docs)["a"]["key"]
    twin = home / "stores" / (key[:6] + "f" * (len(key) - 6))  # a key that shares 6 digits
    shutil.copytree(home / "stores" / key, twin)
    before = {s["key"] for s in listed()}
    result = run("stores", "rm", key[:6])
    assert result.exit_code == 1 and result.stderr.startswith("Error: ")
    assert len(result.stderr.splitlines()) == 1
    assert (
        key in result.stderr
        and twin.name in result.stderr
        and "begins 2 store keys" in (result.stderr)
    )
    assert {s["key"] for s in listed()} == before
    result = run("stores", "rm", key[:7])  # one store now
    assert result.exit_code == 0 and [s["key"] for s in listed() if s["key"] == key] == []


def test_a_dead_model_conversion_folder_is_a_leftover_prune_removes(home):
    """A conversion of the default model killed mid-write (or by an older sekv, unmarked and
    old) leaves a `.tmp-*` folder in $SEKV_HOME/models: listed as a leftover and pruned; one
    a live process writes is neither."""
    import os
    import socket

    models = home / "models"
    dead, old, live = (models / f".tmp-SmolLM2-{n}" for n in ("dead", "old", "live"))
    for folder, pid in ((dead, 2**22 + 12345), (old, None), (live, os.getpid())):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"\0" * 3000)
        if pid is not None:
            (folder / ".writer").write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
    os.utime(old, (time.time() - DAY, time.time() - DAY))
    (models / "SmolLM2-done").mkdir()  # a finished copy: not the shelf's
    kinds = {s["path"]: s["kind"] for s in listed()}
    assert kinds.get(str(dead)) == kinds.get(str(old)) == "leftover"
    assert str(live) not in kinds and str(models / "SmolLM2-done") not in kinds
    pruned = run("stores", "prune", "--json")
    assert pruned.exit_code == 0, pruned.output
    assert {e["path"] for e in json.loads(pruned.stdout)["removed"]} == {str(dead), str(old)}
    assert not dead.exists() and not old.exists() and live.exists()
    assert len(listed()) == 3  # the stores


def test_a_read_only_home_lists_its_stores_and_removes_none(home, built, read_only_home):
    from conftest import home_files

    _, docs, _ = built
    before = read_only_home()
    assert len(listed()) == 3
    result = run("stores", "rm", docs["a"])
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith(f"Error: $SEKV_HOME {home} is read-only: its stores cannot")
    assert home_files(home) == before


def test_what_was_removed_is_counted_by_what_it_is():
    from types import SimpleNamespace

    from sekv_cli.stores import counted

    def entries(*kinds):
        return [SimpleNamespace(kind=k, is_work=k in ("resumable", "leftover")) for k in kinds]

    assert counted(entries("span", "blocks")) == "2 stores"
    assert counted(entries("leftover")) == "1 leftover work folder"
    assert counted(entries("leftover", "span", "resumable", "leftover")) == (
        "1 store, 1 interrupted ingest and 2 leftover work folders"
    )
