"""Selections of documents (files and folders, walked safely) and the collection's router."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sekv_core.collection import document_files, joined_document, select_documents
from sekv_core.documents import load_document
from sekv_core.errors import SekvError

FIFOS = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")


def tree(root: Path) -> Path:
    """docs/: a.txt, b.md, notes.docx (not a document), .hidden.md, sub/c.txt, sub/deeper/d.md,
    a link back to docs/ (a loop) and a link to a.txt (read once)."""
    docs = root / "docs"
    (docs / "sub" / "deeper").mkdir(parents=True)
    (docs / "a.txt").write_text("Alpha text about the harbour.")
    (docs / "b.md").write_text("# Bravo\n\nThe mill grinds corn.")
    (docs / "notes.docx").write_text("not a document here")
    (docs / ".hidden.md").write_text("hidden")
    (docs / "sub" / "c.txt").write_text("Charlie reads the tide gauges.")
    (docs / "sub" / "deeper" / "d.md").write_text("Delta keeps the lantern room.")
    (docs / "sub" / "loop").symlink_to(docs, target_is_directory=True)
    (docs / "sub" / "again.txt").symlink_to(docs / "a.txt")
    return docs


def names(paths) -> list[str]:
    return [p.name for p in paths]


def test_a_folder_is_walked_in_name_order_each_file_once_loops_not_followed(tmp_path):
    docs = tree(tmp_path)
    listing = document_files([docs])
    assert names(listing.files) == ["a.txt", "b.md", "c.txt", "d.md"]
    assert listing.skipped == []
    files = document_files([docs / "sub" / "c.txt", docs]).files  # named first, then walked
    assert names(files) == ["c.txt", "a.txt", "b.md", "d.md"]


@FIFOS
def test_special_and_dangling_files_in_a_folder_are_skipped_without_being_opened(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "ok.txt").write_text("Fine text.")
    os.mkfifo(docs / "pipe.txt")  # opening it for reading would block
    (docs / "gone.md").symlink_to(docs / "missing.md")
    (docs / "self.md").symlink_to(docs / "self.md")
    os.mkfifo(docs / "pipe.log")  # not a document's suffix: not even mentioned
    listing = document_files([docs])
    assert names(listing.files) == ["ok.txt"]
    reasons = {s.path.name: s.reason for s in listing.skipped}
    assert set(reasons) == {"pipe.txt", "gone.md", "self.md"}
    assert "not a regular file" in reasons["pipe.txt"]


def test_a_file_named_alone_fails_as_before_and_in_a_collection_is_skipped(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\x00\x01binary")
    good = tmp_path / "good.md"
    good.write_text("Good text.")
    with pytest.raises(SekvError, match="binary"):
        select_documents([bad])
    selection = select_documents([good, bad, tmp_path / "missing.pdf"])
    assert selection.collection and not selection.documents  # read by the collection index
    assert names(selection.files) == ["good.md", "bad.txt", "missing.pdf"]
    alone = select_documents([good])
    assert not alone.collection and alone.documents[0].text == "Good text."


def test_a_folder_of_one_document_is_a_collection(tmp_path):
    (tmp_path / "only.txt").write_text("Just one.")
    assert select_documents([tmp_path]).collection


def test_an_empty_selection_is_an_error(tmp_path):
    with pytest.raises(SekvError, match=r"no documents in .*no \.pdf, \.txt or \.md file in th"):
        select_documents([tmp_path])
    with pytest.raises(SekvError, match="no documents named"):
        select_documents([])


def test_a_folder_whose_documents_all_fail_says_how_many_in_words(tmp_path):
    (tmp_path / "gone.md").symlink_to(tmp_path / "missing.md")
    with pytest.raises(SekvError, match=r"^the only document in '.*' could not be read$"):
        select_documents([tmp_path])
    (tmp_path / "lost.txt").symlink_to(tmp_path / "missing.txt")
    with pytest.raises(SekvError, match=r"^none of the 2 documents in '.*' could be read$"):
        select_documents([tmp_path])


def test_the_joined_document_keeps_every_page(tmp_path):
    (tmp_path / "a.txt").write_text("First.")
    (tmp_path / "b.txt").write_text("Second.")
    docs = [load_document(tmp_path / n) for n in ("a.txt", "b.txt")]
    joined = joined_document(docs)
    assert joined.text == "First.\n\nSecond." and joined.page_starts == (0, 8)
    assert joined.path == tmp_path and len(joined.sha256) == 64


def test_hidden_entries_and_sekv_home_are_left_out_and_counted(tmp_path, monkeypatch):
    """A folder that holds $SEKV_HOME (a shared cache beside the documents) never reads sekv's
    own files; hidden files of a document's kind and hidden folders are counted, other hidden
    files (not documents anyway) are not."""
    from sekv_core.collection import left_out_phrase

    docs = tree(tmp_path)
    home = docs / "cache"
    (home / "models" / "embedder").mkdir(parents=True)
    (home / "models" / "embedder" / "README.md").write_text("A model card, not a document.")
    (home / "chat_history").write_text("old questions")
    (docs / ".obsidian").mkdir()
    (docs / ".obsidian" / "notes.md").write_text("an editor's file")
    (docs / ".DS_Store").write_bytes(b"\0")
    monkeypatch.setenv("SEKV_HOME", str(home))
    selection = select_documents([docs])
    assert names(selection.files) == ["a.txt", "b.md", "c.txt", "d.md"]
    left = selection.left_out
    assert left.hidden_files == (docs / ".hidden.md",)
    assert left.hidden_folders == (docs / ".obsidian",) and left.home == home
    assert left_out_phrase(left) == "1 hidden file, 1 hidden folder and $SEKV_HOME"
    monkeypatch.setenv("SEKV_HOME", str(tmp_path / "linked"))  # the same folder by a link
    (tmp_path / "linked").symlink_to(home, target_is_directory=True)
    assert names(select_documents([docs]).files) == ["a.txt", "b.md", "c.txt", "d.md"]
    with pytest.raises(SekvError, match=r"no \.pdf, .* \(\$SEKV_HOME skipped\)"):
        select_documents([home / "models"])  # a folder inside $SEKV_HOME: never read
    monkeypatch.setenv("SEKV_HOME", str(tmp_path / "elsewhere"))
    selection = select_documents([docs])
    assert "README.md" in names(selection.files) and selection.left_out.home is None
    assert left_out_phrase(selection.left_out) == "1 hidden file and 1 hidden folder"


def test_the_sample_folder_holds_only_its_documents():
    """`sekv ask sample_docs …` reads the two sample documents, each with its answers beside
    it; the page about them is docs/sample-docs.md, not a third document in the folder."""
    samples = Path(__file__).resolve().parents[1] / "sample_docs"
    files = select_documents([samples]).files
    assert names(files) == ["handbook.pdf", "lighthouse.md"]
    assert all(f.with_suffix(".qa.json").is_file() for f in files)
