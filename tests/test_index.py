"""The collection index (``sekv_core/index``) with the real sentence embedder: a question in
other words finds its document, a rare code finds its own; a sync follows edits, deletes and
moves and opens nothing unchanged; a damaged index is moved aside and rebuilt; several
processes sync and ask at once."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

import sekv_core.index.catalog as catalog_module
from sekv_core.errors import SekvError
from sekv_core.index.catalog import Catalog, Synced, default_path, path_of, stored_path
from sekv_core.index.embedder import load_embedder
from sekv_core.index.likelihood import QuestionLikelihood
from sekv_core.index.ranking import Finder, Ranked, question_parts

DOCS = {
    "ferry.md": "# Holm\n\nThe ferry to Holm leaves the quay at seven each morning. Tickets are "
    "sold at the kiosk beside the pier. In winter the crossing takes forty minutes.\n",
    "bread.txt": "Knead the dough for ten minutes, then let it rise in a warm place until it has "
    "doubled. Shape the loaf and put it in a hot oven for half an hour. Flour batch QX7731 came "
    "from the mill at Ostby.\n",
    "vet.md": "Our cat Miso sneezes all day and refuses her food. The vet listened to her chest "
    "and gave us drops for an infection, twice a day for a week.\n",
    "profit.txt": "Quarterly revenue rose nine percent while operating costs fell, so the "
    "company's margin widened. The board raised the dividend.\n",
    "final.md": "The striker scored twice in the second half, and the home side lifted the cup "
    "three goals to one. Fans filled the square until midnight.\n",
    "snow.txt": "Heavy snow closed the mountain pass overnight. Temperatures dropped far below "
    "freezing, and ploughs could not clear the drifts before dawn.\n",
}
# no content word of a question is in its document (only function words are shared)
PARAPHRASES = {
    "When does the boat to the island depart?": "ferry.md",
    "How do I bake homemade bread?": "bread.txt",
    "Which medicine did the animal doctor prescribe for the sick pet?": "vet.md",
    "Did the firm earn more money this season?": "profit.txt",
    "Which team won the football championship?": "final.md",
    "Why was the road through the hills blocked?": "snow.txt",
}
FERRY = "When does the boat to the island depart?"
# by meaning alone snow.txt comes first; only bread.txt holds the code
CODE = "Is QX7731 a kind of snowstorm?"
FILLERS = 14  # with DOCS, the ~20 files two processes sync at once
WORKER = """
import json, os, sys, time
from pathlib import Path
from sekv_core.index.catalog import Catalog
from sekv_core.index.embedder import load_embedder
from sekv_core.index.ranking import Finder

folder, question, barrier = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
embedder = load_embedder()
(barrier / str(os.getpid())).touch()
deadline = time.monotonic() + 60
while len(list(barrier.iterdir())) < int(sys.argv[4]) and time.monotonic() < deadline:
    time.sleep(0.005)
warnings = []
with Catalog(warn=warnings.append) as catalog:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    synced = catalog.sync(files, [folder], embedder=load_embedder)
    top = Finder(catalog, synced.files, embedder).rank(question)[0]
print(json.dumps({"top": files[top.index].name, "warnings": warnings}))
"""


# -- helpers ---------------------------------------------------------------------------------


def write(folder: Path, docs: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in docs.items():
        (folder / name).write_text(text)
    return folder


def files_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def sync(catalog: Catalog, folder: Path) -> Synced:
    """Sync every file under ``folder`` as a collection of that folder."""
    return catalog.sync(files_in(folder), [folder], embedder=load_embedder)


def rank(catalog: Catalog, synced: Synced, question: str) -> list[Ranked]:
    return Finder(catalog, synced.files, load_embedder()).rank(question)


def top_name(catalog: Catalog, synced: Synced, question: str) -> str:
    return synced.files[rank(catalog, synced, question)[0].index].path.name


def holds_word(catalog: Catalog, word: str) -> bool:
    """Whether a passage of the index holds ``word``."""
    return any(word in catalog.passage_text(p).lower() for p in catalog.word_scores(word))


def forbid_reading(monkeypatch) -> None:
    """Make any document read fail the test: what follows must open no file."""

    def refuse(path, *args):
        raise AssertionError(f"{path} was read")

    monkeypatch.setattr(catalog_module, "load_document", refuse)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def audit(path: Path) -> dict:
    """What the index file holds, read with plain SQLite (no check, no rebuild)."""
    with closing(sqlite3.connect(path)) as db:

        def one(sql: str):
            return db.execute(sql).fetchone()[0]

        return {
            "integrity": one("PRAGMA integrity_check"),
            "files": dict(db.execute("SELECT path, content FROM files")),
            "file rows": one("SELECT count(*) FROM files"),
            "contents": one("SELECT count(*) FROM contents"),
            "passages": dict(
                db.execute(
                    "SELECT c.sha256, count(p.id) FROM contents c "
                    "LEFT JOIN passages p ON p.content = c.id GROUP BY c.id"
                )
            ),
            "unheld": one(
                "SELECT count(*) FROM files WHERE content IS NOT NULL "
                "AND content NOT IN (SELECT id FROM contents)"
            ),
            "words": sorted(r[0] for r in db.execute("SELECT rowid FROM passage_words")),
            "passage ids": sorted(r[0] for r in db.execute("SELECT id FROM passages")),
        }


def assert_mirrors(path: Path, *folders: Path) -> dict:
    """The index holds exactly the files under ``folders``, each once, each text once with its
    passages and their words; returns the audit."""
    found = audit(path)
    files = [p for folder in folders for p in files_in(folder)]
    assert found["integrity"] == "ok"
    assert found["file rows"] == len(files)
    assert set(found["files"]) == {str(p) for p in files}
    assert found["unheld"] == 0
    assert found["contents"] == len(found["passages"])
    assert set(found["passages"]) == {sha(p) for p in files}
    assert min(found["passages"].values()) > 0
    assert found["words"] == found["passage ids"]
    return found


def crowd(folder: Path) -> Path:
    """DOCS and FILLERS inventory notes: ~20 small files."""
    notes = {
        f"note-{k:02d}.txt": f"Inventory note {k}: aisle {k} holds {k * 7} boxes of brass "
        f"screws, {k + 3} tins of varnish and one ladder."
        for k in range(FILLERS)
    }
    return write(folder, DOCS | notes)


def start_worker(folder: Path, question: str, barrier: Path, party: int) -> subprocess.Popen:
    """A Python process that loads the embedder, waits until ``party`` processes are at the
    ``barrier``, then syncs ``folder`` and ranks ``question`` (prints JSON)."""
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, str(folder), question, str(barrier), str(party)],
        cwd=Path(__file__).parents[1],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(worker: subprocess.Popen) -> dict:
    out, err = worker.communicate(timeout=120)
    assert worker.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def folder(tmp_path) -> Path:
    return write(tmp_path / "docs", DOCS)


@pytest.fixture
def catalog():
    with Catalog() as opened:
        yield opened


@pytest.fixture
def shared_models(sekv_home) -> None:
    """This test's $SEKV_HOME lends its processes the embedder this process unpacked."""
    unpacked = load_embedder().folder
    target = sekv_home / "models" / unpacked.name
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(unpacked, target_is_directory=True)


# -- ranking ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def synced_docs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranked")
    with Catalog(root / "index.sqlite") as opened:
        yield opened, sync(opened, write(root / "docs", DOCS))


@pytest.mark.parametrize("question", PARAPHRASES)
def test_question_in_other_words_finds_its_document(synced_docs, question):
    catalog, synced = synced_docs
    ranked = rank(catalog, synced, question)
    assert len(ranked) == len(DOCS)
    assert synced.files[ranked[0].index].path.name == PARAPHRASES[question]
    assert ranked[0].why == "meaning"
    assert all(r.words == 0 for r in ranked)


def test_rare_code_finds_its_document_over_meaning(synced_docs):
    catalog, synced = synced_docs
    ranked = rank(catalog, synced, CODE)
    names = [synced.files[r.index].path.name for r in ranked]
    by_meaning = max(ranked, key=lambda r: r.meaning)
    assert synced.files[by_meaning.index].path.name == "snow.txt"
    assert names[0] == "bread.txt"
    assert ranked[0].why in ("words", "both")
    assert ranked[0].words > 0.5
    assert all(r.words == 0 for r in ranked[1:])


# the fact's file shares the question's place only; the others share its place and topic too
HARBOUR = {
    "pier.md": "In Carrick Bay, the harbour board measured the north pier in early spring. The "
    "mill reviewed the sea wall at Carrick Bay despite the fog. Further checks of the quay are "
    "planned.\n",
    "wall.md": "In Carrick Bay, the coastal patrol repaired the sea wall and the old slipway last "
    "winter. The works at the docks were catalogued by the town council.\n",
    "staff.md": "The town council met in March to review its staff. The officer responsible for "
    "harbour works in Carrick Bay is Yara Szabo. The minutes record a brief vote.\n",
    "boats.md": "Fishing boats at Carrick Bay were counted by the harbour master's clerk in early "
    "spring, and the moorings were inspected after the storms.\n",
}
DOCK = "Which official looks after dock building at Carrick Bay?"


def test_the_model_reads_the_passage_that_answers_over_ones_on_its_topic(tmp_path, default_model):
    reader = QuestionLikelihood(default_model.model, default_model.tokenizer)
    with Catalog(tmp_path / "index.sqlite") as opened:
        synced = sync(opened, write(tmp_path / "docs", HARBOUR))
        alone = Finder(opened, synced.files, load_embedder()).rank(DOCK)
        read = Finder(opened, synced.files, load_embedder(), reader).rank(DOCK)
    assert synced.files[alone[0].index].path.name != "staff.md"  # the embedder alone misses
    assert synced.files[read[0].index].path.name == "staff.md"
    assert read[0].model is not None and all(r.model is None for r in alone)
    assert read[0].model > max(r.model for r in read[1:] if r.model is not None)


@pytest.mark.parametrize(
    "question, parts",
    [
        (
            "When does the boat to the island depart, and which team won the football "
            "championship?",
            2,
        ),
        ("What did the vet give the cat? Why was the pass through the hills closed?", 2),
        ("How do I bake bread; what did the board do with the dividend?", 2),
        ("Who and what won the cup?", 1),  # a part of fewer than four words stays joined
        ("Which team won the championship and how?", 1),
        ("What is the time recording system called?", 1),
    ],
)
def test_a_question_in_parts_is_split_where_each_asks_its_own(question, parts):
    got = question_parts(question)
    assert len(got) == parts
    assert " ".join(got).replace(",", "").split()[:3] == question.replace(",", "").split()[:3]


def test_each_part_of_a_question_finds_its_own_document(synced_docs):
    catalog, synced = synced_docs
    question = "When does the boat to the island depart, and which team won the football cup?"
    ranked = rank(catalog, synced, question)
    assert {synced.files[r.index].path.name for r in ranked[:2]} == {"ferry.md", "final.md"}
    assert ranked[0].part is not None and ranked[0].part != ranked[1].part
    assert len({r.index for r in ranked}) == len(ranked) == len(DOCS)


# -- following the files ---------------------------------------------------------------------


def test_edited_file_is_read_again(catalog, folder):
    sync(catalog, folder)
    (folder / "snow.txt").write_text("A gale tore the roof off the boathouse at Varnes.\n")
    synced = sync(catalog, folder)
    assert (synced.read, synced.unchanged, synced.followed) == (1, len(DOCS) - 1, 0)
    assert holds_word(catalog, "boathouse")
    assert not holds_word(catalog, "ploughs")
    assert_mirrors(default_path(), folder)


def test_deleted_file_is_dropped_with_its_text(catalog, folder):
    before = sync(catalog, folder)
    snow = next(f.content for f in before.files if f.path.name == "snow.txt")
    (folder / "snow.txt").unlink()
    synced = sync(catalog, folder)
    assert (synced.read, synced.dropped, synced.unchanged) == (0, 1, len(DOCS) - 1)
    assert catalog.passages([snow]).ids.size == 0
    assert not holds_word(catalog, "ploughs")
    assert_mirrors(default_path(), folder)


@pytest.mark.parametrize(
    "target",
    ["holm-ferry.md", "sea/ferry.md", "snow.txt"],
    ids=["renamed", "into a subfolder", "over another file"],
)
def test_moved_file_is_followed_not_read(catalog, folder, monkeypatch, target):
    before = sync(catalog, folder)
    ferry = next(f.content for f in before.files if f.path.name == "ferry.md")
    (folder / target).parent.mkdir(exist_ok=True)
    os.replace(folder / "ferry.md", folder / target)
    forbid_reading(monkeypatch)
    synced = sync(catalog, folder)
    assert (synced.read, synced.followed, synced.dropped) == (0, 1, 0)
    moved = next(f for f in synced.files if f.path == folder / target)
    assert moved.content == ferry
    assert top_name(catalog, synced, FERRY) == Path(target).name
    assert_mirrors(default_path(), folder)


def test_a_name_that_is_not_utf8_is_indexed_followed_and_dropped(catalog, folder, monkeypatch):
    """A file whose name's bytes are not UTF-8 (Python holds it with surrogate escapes) is
    kept under a path that turns back into its own: found unchanged, followed when renamed,
    dropped when gone."""
    raw = os.path.join(os.fsencode(folder), b"r\xe9port.md")
    with open(raw, "w") as f:
        f.write(DOCS["ferry.md"].replace("ferry", "barge"))
    name = Path(os.fsdecode(raw))
    first = sync(catalog, folder)
    by_path = {f.path: f for f in first.files}
    assert by_path[name].content is not None and first.read == len(DOCS) + 1
    stored = set(audit(default_path())["files"])
    assert f"bytes:{folder}/r%E9port.md" in stored and str(folder / "ferry.md") in stored
    forbid_reading(monkeypatch)
    assert sync(catalog, folder).unchanged == len(DOCS) + 1
    renamed = Path(os.fsdecode(os.path.join(os.fsencode(folder), b"r\xe9port-\xff.md")))
    os.replace(name, renamed)
    moved = sync(catalog, folder)
    assert (moved.read, moved.followed) == (0, 1)
    assert {f.path: f.content for f in moved.files}[renamed] == by_path[name].content
    renamed.unlink()
    assert sync(catalog, folder).dropped == 1
    assert_mirrors(default_path(), folder)


def test_stored_paths_turn_back_into_the_paths_named():
    for path in ["/d/ferry.md", "/d/r%E9port.md", os.fsdecode(b"/d/r\xe9port %25.md")]:
        assert path_of(stored_path(path)) == path
    assert stored_path("/d/r%E9port.md") == "/d/r%E9port.md"  # text is kept as it is


def test_unchanged_sync_opens_no_file(catalog, folder, monkeypatch):
    before = sync(catalog, folder)
    forbid_reading(monkeypatch)
    synced = sync(catalog, folder)
    assert (synced.read, synced.followed, synced.unchanged) == (0, 0, len(DOCS))
    assert synced.files == before.files


def test_same_bytes_share_one_text(catalog, folder):
    sync(catalog, folder)
    passages = catalog.counts()["passages"]
    shutil.copy(folder / "ferry.md", folder / "copy.md")
    synced = sync(catalog, folder)
    by_name = {f.path.name: f for f in synced.files}
    assert by_name["copy.md"].content == by_name["ferry.md"].content
    counts = catalog.counts()
    assert (counts["files"], counts["contents"]) == (len(DOCS) + 1, len(DOCS))
    assert counts["passages"] == passages
    ranked = rank(catalog, synced, FERRY)
    assert {synced.files[r.index].path.name for r in ranked[:2]} == {"ferry.md", "copy.md"}
    assert ranked[0].score == ranked[1].score
    (folder / "ferry.md").unlink()
    after = sync(catalog, folder)
    assert (after.dropped, after.read) == (1, 0)
    assert catalog.counts()["passages"] == passages
    assert holds_word(catalog, "holm")
    assert top_name(catalog, after, FERRY) == "copy.md"
    assert_mirrors(default_path(), folder)


def test_unreadable_file_is_remembered_not_read_again(catalog, folder, monkeypatch):
    (folder / "blob.txt").write_bytes(bytes(range(256)) * 8)
    synced = sync(catalog, folder)
    blob = next(f for f in synced.files if f.path.name == "blob.txt")
    assert blob.content is None and "binary" in blob.error
    assert synced.read == len(DOCS) + 1
    forbid_reading(monkeypatch)
    again = sync(catalog, folder)
    assert (again.read, again.unchanged) == (0, len(DOCS) + 1)
    assert next(f for f in again.files if f.path.name == "blob.txt") == blob


# -- damage ----------------------------------------------------------------------------------


def garbage(path: Path) -> None:
    path.write_bytes(os.urandom(4096))


def foreign(path: Path) -> None:
    path.unlink()
    with closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE x(a)")
        db.execute("INSERT INTO x VALUES (1)")
        db.commit()


def other_schema(path: Path) -> None:
    with closing(sqlite3.connect(path)) as db:
        db.execute("UPDATE meta SET value = '0' WHERE key = 'schema'")
        db.commit()


def lost_table(path: Path) -> None:
    with closing(sqlite3.connect(path)) as db:
        db.execute("DROP TABLE passages")
        db.commit()


def truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def scribbled(path: Path) -> None:
    """The last page (4 KiB) overwritten: the schema reads well, the check fails."""
    with path.open("r+b") as f:
        f.seek(-4096, os.SEEK_END)
        f.write(b"\xff" * 4096)


@pytest.mark.parametrize(
    "damage", [garbage, foreign, other_schema, lost_table, truncated, scribbled]
)
def test_damaged_index_is_moved_aside_and_rebuilt(folder, damage):
    path = default_path()
    with Catalog() as catalog:
        sync(catalog, folder)
    damage(path)
    warnings: list[str] = []
    with Catalog(warn=warnings.append) as catalog:
        assert len(warnings) == 1 and "rebuilt" in warnings[0]
        assert path.with_name("index.sqlite.damaged").is_file()
        synced = sync(catalog, folder)
        assert synced.read == len(DOCS)
        assert top_name(catalog, synced, FERRY) == "ferry.md"
    assert len(warnings) == 1
    assert_mirrors(path, folder)


def test_busy_index_is_not_taken_for_damaged(catalog, folder, monkeypatch):
    sync(catalog, folder)
    monkeypatch.setattr(catalog_module, "BUSY_SECONDS", 0.1)
    warnings: list[str] = []
    (folder / "snow.txt").write_text("A gale tore the roof off the boathouse at Varnes.\n")
    with Catalog(warn=warnings.append) as busy:
        with closing(sqlite3.connect(default_path(), isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")  # another process writing, longer than we wait
            with pytest.raises(SekvError, match="locked"):
                sync(busy, folder)
            other.execute("ROLLBACK")
        assert warnings == []
        assert not default_path().with_name("index.sqlite.damaged").exists()
        assert sync(busy, folder).read == 1
    assert_mirrors(default_path(), folder)


# -- several processes -----------------------------------------------------------------------


def test_writer_between_transactions_never_leaves_a_file_without_its_text(
    catalog, folder, tmp_path, monkeypatch
):
    """Another process may write, and drop the texts no file holds, between any two of a
    sync's transactions (here it does after every one)."""
    other = Catalog()
    note = tmp_path / "note.txt"
    commit = catalog._transaction

    def then_other_writes(work):
        result = commit(work)
        note.write_text(note.read_text() + " And one more.")  # a new text each time
        other.sync([note], embedder=load_embedder)
        return result

    note.write_text("A note.")
    monkeypatch.setattr(catalog, "_transaction", then_other_writes)
    synced = sync(catalog, folder)
    other.close()
    assert all(f.sha256 and catalog.passages([f.content]).ids.size for f in synced.files)
    found = audit(default_path())
    assert found["unheld"] == 0
    assert set(found["passages"]) == {sha(p) for p in files_in(folder)} | {sha(note)}


def test_processes_sync_and_ask_at_once(tmp_path, folder, shared_models):
    """Two processes open a new index and sync the same ~20 files at once, while this one
    syncs its own and asks again and again."""
    crowded = crowd(tmp_path / "crowd")
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    workers = [start_worker(crowded, FERRY, barrier, 3) for _ in range(2)]
    (barrier / "asker").touch()
    deadline = time.monotonic() + 120
    while len(list(barrier.iterdir())) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    asked = 0
    with Catalog() as catalog:
        while any(w.poll() is None for w in workers) and time.monotonic() < deadline:
            synced = sync(catalog, folder)
            assert synced.read + synced.unchanged == len(DOCS)
            assert top_name(catalog, synced, FERRY) == "ferry.md"
            asked += 1
            time.sleep(0.02)  # the CPUs are the writers' too
    assert asked >= 2
    assert [finish(w) for w in workers] == [{"top": "ferry.md", "warnings": []}] * 2
    assert not default_path().with_name("index.sqlite.damaged").exists()
    found = assert_mirrors(default_path(), folder, crowded)
    with Catalog(tmp_path / "clean.sqlite") as clean:
        sync(clean, crowded)
    assert found["passages"] == audit(tmp_path / "clean.sqlite")["passages"]


# -- a read-only home --------------------------------------------------------------------------


def test_a_read_only_home_index_answers_and_is_never_written(folder, read_only_home):
    """A shared cache mounted read-only: its index is read (immutable without a -shm file,
    plain read-only with one) and never written; a file it would have to record is an
    error that says why, and nothing is written either."""
    from conftest import home_files

    with Catalog() as writer:
        sync(writer, folder)
    home = default_path().parent
    before = read_only_home()
    with Catalog() as catalog:
        synced = sync(catalog, folder)
        assert synced.unchanged == len(DOCS) and synced.read == 0
        assert top_name(catalog, synced, FERRY) == "ferry.md"
    assert home_files(home) == before
    (folder / "new.md").write_text("The lighthouse keeper's dog is called Biscuit.\n")
    (folder / "snow.txt").unlink()  # gone: a writable index drops it, this one keeps it
    with Catalog() as catalog, pytest.raises(SekvError) as info:
        sync(catalog, folder)
    assert str(info.value).startswith(f"$SEKV_HOME {home} is read-only: the collection index")
    assert "cannot record 1 new or changed file (new.md)" in str(info.value)
    assert home_files(home) == before


def test_a_read_only_home_index_another_process_has_open_is_read(folder, read_only_home):
    """With its -shm file there (a process beside has it open), the index is read through it."""
    with Catalog() as writer:
        sync(writer, folder)
    with closing(sqlite3.connect(default_path())) as other:
        other.execute("SELECT count(*) FROM files").fetchone()
        assert Path(f"{default_path()}-shm").exists()
        read_only_home()
        with Catalog() as catalog:
            synced = sync(catalog, folder)
            assert synced.unchanged == len(DOCS) and synced.read == 0
            assert top_name(catalog, synced, FERRY) == "ferry.md"


@pytest.mark.parametrize("index", ["missing", "damaged"])
def test_a_read_only_home_without_a_usable_index_is_an_error(folder, read_only_home, index):
    from conftest import home_files

    (default_path().parent / "stores").mkdir(parents=True)
    if index == "damaged":
        with Catalog() as writer:
            sync(writer, folder)
        scribbled(default_path())
    before = read_only_home()
    said = {
        "missing": "it holds no collection index",
        "damaged": "the collection index there cannot be used (",
    }
    with pytest.raises(SekvError) as info:
        Catalog()
    assert f"is read-only: {said[index]}" in str(info.value)
    assert home_files(default_path().parent) == before  # not moved aside, not made
