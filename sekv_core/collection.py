"""A selection of documents: the files and folders a user names, read.

A folder is walked recursively for .pdf, .txt and .md files, in name order. Hidden entries
(names starting with ``.``) and sekv's own data folder (``$SEKV_HOME``, when a folder holds
it) are left out, and counted (:class:`LeftOut`); a folder reached twice (a symlink loop, or
two links to one folder) is walked once; a file reached twice (named and inside a named folder,
hard or symbolic links) is read once. FIFOs, devices and sockets are never opened.

A file named alone is read as it always was: a document that cannot be read is an error. In a
collection (a folder, or several paths) such a document is one warning and skipped; the
selection keeps what was skipped and why. No document at all is an error. No torch here: the
CLI reads the selection before it loads a model.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .config import MAX_TOKENS
from .documents import SUPPORTED_SUFFIXES, Document, load_document
from .errors import SekvError
from .paths import home_path

JOIN = "\n\n"  # between the documents of a joined one (joined_document)


@dataclass(frozen=True)
class Skipped:
    """A document of a collection that was not read: its path and the one-line reason."""

    path: Path
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"path": str(self.path), "reason": self.reason}


@dataclass(frozen=True)
class LeftOut:
    """What the folders walked hold that was passed over unread: hidden entries (a name
    starting with ``.``: files of a document's kind, and folders) and ``home``, sekv's own data
    folder (``$SEKV_HOME``: stores, models) where a folder named holds it."""

    hidden_files: tuple[Path, ...] = ()
    hidden_folders: tuple[Path, ...] = ()
    home: Path | None = None

    def __bool__(self) -> bool:
        return bool(self.hidden_files or self.hidden_folders) or self.home is not None

    def to_json(self) -> dict[str, object]:
        return {
            "hidden_files": [str(p) for p in self.hidden_files],
            "hidden_folders": [str(p) for p in self.hidden_folders],
            "home": None if self.home is None else str(self.home),
        }


@dataclass(frozen=True)
class Listing:
    """The files a collection's paths name, in order, each once; those of a document's kind
    that cannot be documents (``skipped``); what the walk passed over (``left_out``)."""

    files: list[Path]
    skipped: list[Skipped]
    left_out: LeftOut = LeftOut()


@dataclass(frozen=True)
class Selection:
    """What ``paths`` name. One file named alone (``collection`` False): ``documents`` holds it,
    read. A collection (a folder or several paths): ``files``, in order, not read here (the
    collection index reads a file only when it is new or changed: :mod:`sekv_core.index`),
    ``folders`` the folders named (their indexed files that are gone are dropped), and the
    entries ``skipped`` as not documents at all, and what the walk ``left_out``."""

    documents: list[Document]
    skipped: list[Skipped]
    collection: bool
    files: list[Path] = field(default_factory=list)
    folders: list[Path] = field(default_factory=list)
    left_out: LeftOut = LeftOut()


def is_collection(paths: Sequence[str | Path]) -> bool:
    """Whether ``paths`` name a collection: several paths, or a folder."""
    return len(paths) != 1 or Path(paths[0]).is_dir()


def select_documents(
    paths: Sequence[str | Path],
    max_tokens: int | None = MAX_TOKENS,
    warn: Callable[[str], None] | None = None,
) -> Selection:
    """What ``paths`` name (files and folders; see the module's docstring): a single file is
    read (``max_tokens``: one too big for that many tokens is refused before it is read,
    :func:`sekv_core.documents.load_document`); a collection's files are listed. ``warn`` is
    told of each entry skipped. Raises SekvError for a single file that cannot be read, and
    when a collection names no file at all.
    """
    if not paths:
        raise SekvError("no documents named; pass a file, several files or a folder")
    if not is_collection(paths):
        return Selection([load_document(paths[0], max_tokens)], [], collection=False)
    listing = document_files(paths)
    files, skipped = listing.files, sorted(listing.skipped, key=lambda s: str(s.path))
    if warn:
        for s in skipped:
            warn(f"skipped: {s.reason}")
    if not files:
        named = ", ".join(f"'{p}'" for p in paths[:3]) + (", …" if len(paths) > 3 else "")
        if skipped:
            raise SekvError(none_read(len(skipped), named))
        where = "that directory" if len(paths) == 1 else "those directories"
        passed = left_out_phrase(listing.left_out)
        passed = f" ({passed} skipped)" if passed else ""
        raise SekvError(f"no documents in {named}: no .pdf, .txt or .md file in {where}{passed}")
    folders = [Path(p) for p in paths if Path(p).is_dir()]
    return Selection([], skipped, True, files, folders, listing.left_out)


def none_read(n: int, where: str) -> str:
    """The error for a collection (``where``: its paths, quoted) none of whose ``n``
    documents could be read."""
    if n == 1:
        return f"the only document in {where} could not be read"
    return f"none of the {n} documents in {where} could be read"


def left_out_phrase(left_out: LeftOut) -> str:
    """``left_out`` in words: ``3 hidden files and $SEKV_HOME``, ``1 hidden file, 2 hidden
    folders and $SEKV_HOME`` ("" if nothing)."""
    parts = [
        f"{n} hidden {kind}{'s' * (n != 1)}"
        for n, kind in (
            (len(left_out.hidden_files), "file"),
            (len(left_out.hidden_folders), "folder"),
        )
        if n
    ]
    if left_out.home is not None:
        parts.append("$SEKV_HOME")
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else "".join(parts)


def document_files(paths: Sequence[str | Path]) -> Listing:
    """The files a collection's ``paths`` name, each once, those that cannot be documents, and
    what the folders' walk left out.

    A path named is taken whatever its suffix (reading it says what is wrong); inside a folder
    only supported suffixes count, and one of them that is not a regular file is skipped.
    """
    files: list[Path] = []
    skipped: list[Skipped] = []
    hidden: tuple[list[Path], list[Path]] = ([], [])  # files, folders
    seen_files: set[tuple[int, int]] = set()
    seen_dirs: set[tuple[int, int]] = set()
    home = _home()
    home_met: list[Path] = []

    def add(path: Path, st: os.stat_result) -> None:
        key = (st.st_dev, st.st_ino)
        if key not in seen_files:
            seen_files.add(key)
            files.append(path)

    for named in map(Path, paths):
        try:
            st = os.stat(named)
        except OSError:
            files.append(named)  # missing or a dangling link: reading it says which
            continue
        if not stat.S_ISDIR(st.st_mode):
            add(named, st)
        elif home is not None and _inside(named, home[0]):
            home_met.append(named)
        else:
            _walk(named, seen_dirs, add, skipped, hidden, home, home_met)
    left_out = LeftOut(*map(tuple, hidden), home_met[0] if home_met else None)
    return Listing(files, skipped, left_out)


def _home() -> tuple[Path, tuple[int, int]] | None:
    """``$SEKV_HOME`` resolved, with its (device, inode); None if it does not exist."""
    try:
        home = home_path().resolve()
        st = os.stat(home)
    except OSError:
        return None
    return home, (st.st_dev, st.st_ino)


def _inside(folder: Path, home: Path) -> bool:
    """Whether ``folder`` is ``home`` or lies under it."""
    try:
        return folder.resolve().is_relative_to(home)
    except OSError:
        return False


def _walk(
    root: Path,
    seen: set[tuple[int, int]],
    add: Callable[[Path, os.stat_result], None],
    skipped: list[Skipped],
    hidden: tuple[list[Path], list[Path]],
    home: tuple[Path, tuple[int, int]] | None,
    home_met: list[Path],
) -> None:
    """Depth first, in name order: the supported files under ``root`` to ``add``, folders
    already ``seen`` (by device and inode) not walked again; hidden files of a document's kind
    and hidden folders to ``hidden``, ``$SEKV_HOME`` (``home``) to ``home_met``, unwalked."""
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            st = os.stat(folder)
            if home is not None and (st.st_dev, st.st_ino) == home[1]:
                home_met.append(folder)
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            skipped.append(Skipped(folder, f"cannot read '{folder}': {exc.strerror or exc}"))
            continue
        folders = []
        for entry in entries:
            path = Path(entry.path)
            supported = path.suffix.lower() in SUPPORTED_SUFFIXES
            if entry.name.startswith("."):
                if _is_dir(entry):
                    hidden[1].append(path)
                elif supported:
                    hidden[0].append(path)
                continue
            try:
                st = os.stat(path)  # through links: a loop or a dangling one raises
            except OSError as exc:
                if supported:
                    skipped.append(Skipped(path, f"cannot read '{path}': {exc.strerror or exc}"))
                continue
            if stat.S_ISDIR(st.st_mode):
                folders.append(path)
            elif supported and stat.S_ISREG(st.st_mode):
                add(path, st)
            elif supported:
                skipped.append(Skipped(path, f"cannot read '{path}': not a regular file"))
        stack.extend(reversed(folders))  # the first folder by name is walked first


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def joined_document(documents: Sequence[Document]) -> Document:
    """``documents`` as one: their texts in order, a blank line between, each page of each
    a page of the whole (what a method reading the whole collection at once is given)."""
    starts = []
    for doc, at in zip(documents, joined_starts(documents), strict=True):
        starts += [at + s for s in doc.page_starts]
    text = JOIN.join(d.text for d in documents)
    digest = hashlib.sha256("\0".join(d.sha256 for d in documents).encode()).hexdigest()
    root = Path(os.path.commonpath([d.path.resolve() for d in documents]))
    return Document(root, digest, text, tuple(starts), "md")


def joined_starts(documents: Sequence[Document]) -> list[int]:
    """Where each of ``documents`` starts in the text of :func:`joined_document` of them."""
    starts, at = [], 0
    for doc in documents:
        starts.append(at)
        at += len(doc.text) + len(JOIN)
    return starts
