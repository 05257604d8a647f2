"""The collection index: one SQLite file under ``$SEKV_HOME`` of every document sekv has read.

Tables (schema :data:`SCHEMA`, the file's ``application_id`` :data:`APP_ID`):

- ``files``: each file by absolute path with the ``(size, mtime_ns, dev, inode)`` it had when
  read, and its ``content`` (or the ``error`` it could not be read for); a path whose bytes are
  not UTF-8 is kept as ``bytes:`` and its bytes percent-quoted (:func:`stored_path`): text, and
  never an absolute path, so a reader that does not know the form passes it by;
- ``contents``: each distinct text by the SHA-256 of its file's bytes (two copies of a file
  share one), its characters, words and pages;
- ``passages``: each content's passages (runs of whole sentences of about
  :data:`PASSAGE_WORDS` words: characters, page) with the sentence embedder's unit vector
  (float16);
- ``passage_words``: FTS5 over the passages' text (rowid = the passage's id), Porter-stemmed.

:meth:`Catalog.sync` brings a list of files up to date: a file whose size, time and inode are
unchanged is not opened; a new path with the inode and time of an indexed file that is gone is
that file moved (followed, not read); an edited file is read again and its new text indexed
unless an indexed file already has those bytes; files gone from a folder that was synced are
dropped, and a content no file holds any more with them. Writes run in short ``BEGIN
IMMEDIATE`` transactions in WAL mode, so several processes can sync and ask at once; reading
and embedding a document happen outside them.

A file that is not such an index, or one of another schema or embedder, is never used: it is
moved aside (``index.sqlite.damaged``) and the index rebuilt (:class:`IndexDamaged` names why).

In a read-only ``$SEKV_HOME`` (:func:`sekv_core.paths.read_only`) the index is opened
read-only (``mode=ro``; ``immutable`` where no ``-shm`` file is there to share, as a read-only
folder cannot hold a new one) and nothing is written: a sync whose files are all unchanged
answers as usual; one that would record a new, edited or moved file, or a damaged index, is a
SekvError.
"""

from __future__ import annotations

import math
import os
import re
import sqlite3
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote_from_bytes, unquote_to_bytes

import numpy as np

from ..documents import Document, load_document
from ..errors import SekvError, one_line
from ..lexical import STOPWORDS, words
from ..passages import sentence_ends
from ..paths import read_only, read_only_error, sekv_home
from .embedder import NAME as EMBEDDER
from .embedder import Embedder

SCHEMA = 1
APP_ID = 0x53654B56  # "SeKV"
FILE_NAME = "index.sqlite"
PASSAGE_WORDS = 12  # a passage ends at the first sentence end past this many words ...
PASSAGE_MAX_WORDS = 60  # ... or here at the latest (a sentence that long is cut)
BUSY_SECONDS = 60.0  # how long a writer waits for another process's transaction
NOT_TEXT = "bytes:"  # a stored path that is its file's bytes, quoted (stored_path)

TABLES = """
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE contents(
    id INTEGER PRIMARY KEY, sha256 TEXT UNIQUE NOT NULL,
    chars INTEGER NOT NULL, words INTEGER NOT NULL, pages INTEGER NOT NULL);
CREATE TABLE files(
    path TEXT PRIMARY KEY, size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL,
    dev INTEGER NOT NULL, ino INTEGER NOT NULL,
    content INTEGER REFERENCES contents(id), error TEXT);
CREATE INDEX files_inode ON files(dev, ino);
CREATE INDEX files_content ON files(content);
CREATE TABLE passages(
    id INTEGER PRIMARY KEY, content INTEGER NOT NULL REFERENCES contents(id),
    start INTEGER NOT NULL, end INTEGER NOT NULL, page INTEGER NOT NULL,
    embedding BLOB NOT NULL);
CREATE INDEX passages_content ON passages(content);
CREATE VIRTUAL TABLE passage_words USING fts5(text, tokenize = 'porter unicode61');
"""
TABLE_NAMES = re.findall(r"CREATE (?:VIRTUAL )?TABLE (\w+)", TABLES)


class IndexDamaged(Exception):
    """The index file is not one sekv can trust (the message says why)."""


@dataclass(frozen=True)
class Indexed:
    """A file of a sync: its path as named, its content's id, hash, characters, words and
    pages (``content`` None: it could not be read, ``error`` says why)."""

    path: Path
    content: int | None
    sha256: str = ""
    chars: int = 0
    words: int = 0
    pages: int = 0
    error: str = ""


@dataclass
class Synced:
    """What a sync did: the files in the order named, and how many of them were read now
    (new or edited), followed (moved), found unchanged; files dropped (gone from a folder)."""

    files: list[Indexed]
    read: int = 0
    followed: int = 0
    unchanged: int = 0
    dropped: int = 0


@dataclass(frozen=True)
class SyncProgress:
    """Where a sync stands: files done of those that must be read, their characters."""

    name: str
    done: int
    total: int
    chars_done: int
    chars: int


def default_path() -> Path:
    return sekv_home() / FILE_NAME


def stored_path(path: str) -> str:
    """``path`` as the ``files`` table keeps it: as it is where it is text (UTF-8), else (a
    name of other bytes, which Python holds with surrogate escapes) ``bytes:`` and its bytes
    percent-quoted; :func:`path_of` turns it back."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return NOT_TEXT + quote_from_bytes(os.fsencode(path), safe="/")
    return path


def path_of(stored: str) -> str:
    """The path a ``files`` row names (:func:`stored_path` turned back)."""
    if stored.startswith(NOT_TEXT):
        return os.fsdecode(unquote_to_bytes(stored[len(NOT_TEXT) :]))
    return stored


class Catalog:
    """The index file at ``path`` (default ``$SEKV_HOME/index.sqlite``), opened, checked and
    made if need be. ``warn`` is told when a damaged file is moved aside and rebuilt; one that
    is only busy, read-only or on a full disk is kept (:class:`SekvError`). One connection,
    used by one thread at a time (a lock serialises callers)."""

    def __init__(self, path: Path | None = None, warn: Callable[[str], None] | None = None) -> None:
        self.path = Path(path) if path is not None else default_path()
        self.warn = warn
        self.lock = threading.RLock()
        self.read_only = self.path.parent.is_dir() and read_only(self.path.parent)
        try:
            self.db = self._open_read_only() if self.read_only else self._open()
        except sqlite3.OperationalError as exc:  # busy, read-only, full: not damage
            raise _unusable(self.path, exc) from None
        except (IndexDamaged, sqlite3.DatabaseError) as exc:
            if self.read_only:  # never used, and it cannot be rebuilt there
                why = f"the collection index there cannot be used ({one_line(exc)})"
                raise read_only_error(why) from None
            self.db = self.rebuild(exc)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> sqlite3.Connection:
        """Connect and check: a new file gets the schema; an existing one must be this
        schema's, for this embedder, and pass SQLite's quick check."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=BUSY_SECONDS, isolation_level=None,
                             check_same_thread=False)  # fmt: skip
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            app = db.execute("PRAGMA application_id").fetchone()[0]
            tables = db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
            if app == 0 and tables == 0:  # a new file: made here (or by a process beside)
                db.execute("BEGIN IMMEDIATE")
                if db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0:
                    for statement in TABLES.split(";")[:-1]:  # executescript would commit
                        db.execute(statement)
                    db.execute("INSERT INTO meta VALUES ('schema', ?), ('embedder', ?)",
                               (str(SCHEMA), EMBEDDER))  # fmt: skip
                    db.execute(f"PRAGMA application_id={APP_ID}")
                db.execute("COMMIT")
                return db
            self._check(db)
            return db
        except BaseException:
            db.close()
            raise

    @staticmethod
    def _check(db: sqlite3.Connection) -> None:
        """IndexDamaged unless ``db`` is a collection index of this schema, for this embedder,
        that passes SQLite's quick check."""
        if db.execute("PRAGMA application_id").fetchone()[0] != APP_ID:
            raise IndexDamaged("it is not a sekv collection index")
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
        if not set(TABLE_NAMES) <= names:
            raise IndexDamaged(f"it lacks the table {min(set(TABLE_NAMES) - names)}")
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        if meta.get("schema") != str(SCHEMA) or meta.get("embedder") != EMBEDDER:
            raise IndexDamaged(
                f"it holds schema {meta.get('schema')} for {meta.get('embedder')}, "
                f"not schema {SCHEMA} for {EMBEDDER}"
            )
        check = db.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise IndexDamaged(f"SQLite's check fails: {check}")

    def _open_read_only(self) -> sqlite3.Connection:
        """Connect read-only and check (the index of a read-only home). SQLite reads a WAL
        index through its ``-shm`` file; without one (the last writer closed it cleanly) the
        file is opened ``immutable``, since no ``-shm`` can be made in a read-only folder."""
        if not self.path.is_file():
            raise read_only_error("it holds no collection index, and one cannot be made there")
        wal, shm = (Path(f"{self.path}{suffix}") for suffix in ("-wal", "-shm"))
        if not shm.exists() and wal.exists() and wal.stat().st_size:
            raise read_only_error(
                "its collection index has writes not yet merged (a -wal file but no -shm), "
                "which cannot be read there"
            )
        mode = "mode=ro" if shm.exists() else "mode=ro&immutable=1"
        uri = f"{self.path.absolute().as_uri()}?{mode}"
        db = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        try:
            self._check(db)
            return db
        except BaseException:
            db.close()
            raise

    def rebuild(self, why: BaseException) -> sqlite3.Connection:
        """Move the file aside (``.damaged``, replacing an older one) and make a new index."""
        with self.lock:
            if getattr(self, "db", None) is not None:
                self.db.close()
            aside = self.path.with_name(self.path.name + ".damaged")
            for suffix in ("-wal", "-shm"):
                Path(str(self.path) + suffix).unlink(missing_ok=True)
            try:
                os.replace(self.path, aside)
            except FileNotFoundError:
                pass
            if self.warn:
                self.warn(
                    f"the collection index {self.path} could not be used ({one_line(why)}); "
                    f"moved it to {aside.name} and rebuilt it"
                )
            self.db = self._open()
            return self.db

    # -- writing -------------------------------------------------------------------------

    def sync(
        self,
        files: Sequence[Path],
        folders: Sequence[Path] = (),
        embedder: Callable[[], Embedder] | None = None,
        max_tokens: int | None = None,
        progress: Callable[[SyncProgress], None] | None = None,
    ) -> Synced:
        """Bring ``files`` up to date (see the module's docstring) and drop the indexed files
        under ``folders`` that are not among them. ``embedder`` gives the sentence embedder
        when a new text must be embedded (loaded only then)."""
        with self.lock:
            try:
                return self._sync(files, folders, embedder, max_tokens, progress)
            except sqlite3.OperationalError as exc:  # busy, read-only, full: not damage
                raise _unusable(self.path, exc) from None
            except sqlite3.DatabaseError as exc:
                self.rebuild(exc)
                return self._sync(files, folders, embedder, max_tokens, progress)

    def _sync(self, files, folders, embedder, max_tokens, progress) -> Synced:
        db = self.db
        known = {
            path_of(row[0]): row[1:]
            for row in db.execute(
                "SELECT path, size, mtime_ns, dev, ino, content, error FROM files"
            )
        }
        absolute = [os.path.abspath(p) for p in files]
        stats: list[os.stat_result | None] = []
        for path in absolute:
            try:
                stats.append(os.stat(path))
            except OSError:
                stats.append(None)
        todo = []
        for i, (path, st) in enumerate(zip(absolute, stats, strict=True)):
            row = known.get(path)
            if st is None or row is None or row[:4] != _stamp(st):
                todo.append(i)
        if todo and self.read_only:
            shown = ", ".join(Path(files[i]).name for i in todo[:3]) + ", …" * (len(todo) > 3)
            raise read_only_error(
                f"the collection index there cannot record {len(todo)} new or changed "
                f"file{'s' * (len(todo) != 1)} ({shown})"
            )
        out = Synced(files=[])
        named_now = set(absolute)
        gone = {p for p in known if p not in named_now}
        by_inode = {known[p][2:4]: p for p in gone}  # (dev, ino) of indexed files not named
        total = sum(stats[i].st_size for i in todo if stats[i] is not None)
        chars_done = 0
        for k, i in enumerate(todo):
            path, st, named = absolute[i], stats[i], Path(files[i])
            if progress:
                progress(SyncProgress(named.name, k, len(todo), chars_done, total))
            moved = by_inode.get((st.st_dev, st.st_ino)) if st is not None else None
            if (
                moved is not None
                and known[moved][:2] == _stamp(st)[:2]
                and not os.path.exists(moved)
            ):
                self._move(moved, path)
                gone.discard(moved)
                known[path] = known.pop(moved)
                out.followed += 1
            else:
                self._read(named, path, st, embedder, max_tokens)
                out.read += 1
            chars_done += st.st_size if st is not None else 0
        if progress and todo:
            progress(SyncProgress("", len(todo), len(todo), total, total))
        under = [os.path.join(os.path.abspath(f), "") for f in folders]
        dropped = [p for p in gone if any(p.startswith(u) for u in under)]
        if dropped and not self.read_only:  # (read-only: kept; they are not asked about)
            out.dropped = self._drop(dropped)
        rows = self._rows()
        out.files = [
            Indexed(Path(named), *rows[path]) if path in rows
            else Indexed(Path(named), None, error="not indexed")
            for path, named in zip(absolute, files, strict=True)
        ]  # fmt: skip
        out.unchanged = len(files) - len(todo)
        return out

    def _read(
        self,
        named: Path,
        path: str,
        st: os.stat_result | None,
        embedder: Callable[[], Embedder] | None,
        max_tokens: int | None,
    ) -> None:
        """Read one file and record it (its content indexed unless known)."""
        try:
            document = load_document(named, max_tokens)
        except SekvError as exc:
            if st is not None:  # remembered, so an unchanged unreadable file is not re-read
                self._write_file(path, st, None, str(exc))
            else:
                self._transaction(
                    lambda db: db.execute("DELETE FROM files WHERE path=?", (stored_path(path),))
                )
            return
        st = st or os.stat(named)
        cut_up = None  # the passages and their vectors, made only if the index lacks the text
        while not self._add_file(path, st, document, cut_up):
            passages = cut(document)
            vectors = None
            if embedder is not None:
                vectors = embedder().embed([document.text[a:b] for a, b, _ in passages])
            cut_up = (passages, vectors)
        self._collect()

    def _add_file(
        self,
        path: str,
        st: os.stat_result,
        document: Document,
        cut_up: tuple[list[tuple[int, int, int]], np.ndarray | None] | None,
    ) -> bool:
        """Record the file with its text in one transaction, so that a text is never seen
        unheld (another process's :meth:`_collect` would drop it); the text and its passages
        (``cut_up``) are inserted unless the index has them (another process may have
        inserted the same bytes meanwhile: then theirs is kept). False, with nothing written,
        when the text must be inserted and ``cut_up`` is None."""

        def insert(db: sqlite3.Connection) -> bool:
            row = db.execute("SELECT id FROM contents WHERE sha256=?", (document.sha256,))
            if (found := row.fetchone()) is not None:
                content = found[0]
            elif cut_up is None:
                return False
            else:
                content = self._insert_content(db, document, *cut_up)
            db.execute(
                "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                (stored_path(path), *_stamp(st), content, None),
            )
            return True

        return self._transaction(insert)

    def _insert_content(
        self,
        db: sqlite3.Connection,
        document: Document,
        passages: list[tuple[int, int, int]],
        vectors: np.ndarray | None,
    ) -> int:
        """Insert a text and its passages (within the caller's transaction)."""
        cursor = db.execute(
            "INSERT INTO contents(sha256, chars, words, pages) VALUES (?, ?, ?, ?)",
            (document.sha256, len(document.text), len(words(document.text)), document.pages),
        )
        content = cursor.lastrowid
        for k, (a, b, page) in enumerate(passages):
            blob = b"" if vectors is None else vectors[k].astype(np.float16).tobytes()
            pid = db.execute(
                "INSERT INTO passages(content, start, end, page, embedding) VALUES (?, ?, ?, ?, ?)",
                (content, a, b, page, blob),
            ).lastrowid
            db.execute(
                "INSERT INTO passage_words(rowid, text) VALUES (?, ?)",
                (pid, document.text[a:b]),
            )
        return content

    def _write_file(
        self, path: str, st: os.stat_result, content: int | None, error: str | None
    ) -> None:
        self._transaction(
            lambda db: db.execute(
                "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                (stored_path(path), *_stamp(st), content, error),
            )
        )
        self._collect()

    def _move(self, old: str, new: str) -> None:
        self._transaction(
            lambda db: db.execute(
                "UPDATE OR REPLACE files SET path=? WHERE path=?",
                (stored_path(new), stored_path(old)),
            )
        )
        self._collect()  # a file moved over another replaces its row (and maybe its text)

    def _drop(self, paths: list[str]) -> int:
        def drop(db: sqlite3.Connection) -> int:
            delete = "DELETE FROM files WHERE path=?"
            return sum(db.execute(delete, (stored_path(p),)).rowcount for p in paths)

        n = self._transaction(drop)
        self._collect()
        return n

    def _collect(self) -> None:
        """Drop contents no file holds (their passages and words with them)."""

        def collect(db: sqlite3.Connection) -> None:
            orphans = [
                r[0]
                for r in db.execute(
                    "SELECT id FROM contents WHERE id NOT IN "
                    "(SELECT content FROM files WHERE content IS NOT NULL)"
                )
            ]
            for content in orphans:
                db.execute(
                    "DELETE FROM passage_words WHERE rowid IN "
                    "(SELECT id FROM passages WHERE content=?)",
                    (content,),
                )
                db.execute("DELETE FROM passages WHERE content=?", (content,))
                db.execute("DELETE FROM contents WHERE id=?", (content,))

        self._transaction(collect)

    def _transaction(self, work: Callable[[sqlite3.Connection], object]):
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            result = work(db)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return result

    # -- reading -------------------------------------------------------------------------

    def _rows(self) -> dict[str, tuple]:
        """Every indexed file by absolute path: its :class:`Indexed` fields after the path."""
        query = (
            "SELECT f.path, f.content, c.sha256, c.chars, c.words, c.pages, f.error "
            "FROM files f LEFT JOIN contents c ON c.id = f.content"
        )
        return {
            path_of(r[0]): (r[1], r[2] or "", r[3] or 0, r[4] or 0, r[5] or 0, r[6] or "")
            for r in self.db.execute(query)
        }

    def passages(self, contents: Sequence[int]) -> Passages:
        """Every passage of ``contents``: ids, owners, characters, pages and embeddings."""
        with self.lock:
            wanted = sorted(set(contents))
            self.db.execute("CREATE TEMP TABLE IF NOT EXISTS wanted(content INTEGER PRIMARY KEY)")
            self.db.execute("DELETE FROM wanted")
            self.db.executemany("INSERT INTO wanted VALUES (?)", [(c,) for c in wanted])
            rows = self.db.execute(
                "SELECT p.id, p.content, p.start, p.end, p.page FROM passages p "
                "JOIN wanted w ON w.content = p.content ORDER BY p.id"
            ).fetchall()
            blobs = [
                r[0]
                for r in self.db.execute(
                    "SELECT p.embedding FROM passages p "
                    "JOIN wanted w ON w.content = p.content ORDER BY p.id"
                )
            ]
        n = len(rows)
        table = np.array(rows, dtype=np.int64).reshape(n, 5)  # (P, 5): id, content, chars, page
        ids, owners, chars, pages = table[:, 0], table[:, 1], table[:, 2:4], table[:, 4]
        dims = max((len(b) for b in blobs), default=0) // 2
        if all(len(b) == 2 * dims for b in blobs):  # every passage embedded: one buffer
            vectors = np.frombuffer(b"".join(blobs), dtype=np.float16).reshape(n, dims)
        else:
            vectors = np.zeros((n, dims), dtype=np.float16)
            for k, blob in enumerate(blobs):
                if len(blob) == 2 * dims:
                    vectors[k] = np.frombuffer(blob, dtype=np.float16)
        return Passages(ids, owners, chars, pages, vectors)

    def word_scores(self, question: str, limit: int = 10_000) -> dict[int, float]:
        """The passages holding a word of ``question`` (function words left out), by passage
        id: FTS5's BM25 over the most it could be, the sum of the words' idf (what a passage
        of average length holding each word once scores): about 1 for a passage holding all
        of them, near 0 for one holding only a word common in the index. Never above 1."""
        terms = fts_terms(question)
        if not terms:
            return {}
        with self.lock:
            n = self.db.execute("SELECT count(*) FROM passages").fetchone()[0]
            most = 0.0
            for t in terms:  # passages holding each word (FTS5 stems it as it stemmed them)
                k = self.db.execute(
                    "SELECT count(*) FROM passage_words WHERE passage_words MATCH ?", (f'"{t}"',)
                ).fetchone()[0]
                most += max(1e-6, math.log((n - k + 0.5) / (k + 0.5))) if k else 0.0
            rows = self.db.execute(
                "SELECT rowid, -bm25(passage_words) FROM passage_words WHERE passage_words "
                "MATCH ? ORDER BY rank LIMIT ?",
                (" OR ".join(f'"{t}"' for t in terms), limit),
            ).fetchall()
        return {r[0]: min(1.0, r[1] / most) for r in rows} if most > 0 else {}

    def passage_text(self, passage: int) -> str:
        """One passage's text (the index keeps it: a source needs no document read)."""
        with self.lock:
            row = self.db.execute(
                "SELECT text FROM passage_words WHERE rowid=?", (passage,)
            ).fetchone()
        return row[0] if row else ""

    def passage_texts(self, passages: Sequence[int]) -> list[str]:
        """Several passages' texts, in the order asked ("" for one the index lacks)."""
        marks = ",".join("?" * len(passages))
        with self.lock:
            rows = self.db.execute(
                f"SELECT rowid, text FROM passage_words WHERE rowid IN ({marks})", list(passages)
            ).fetchall()
        texts = dict(rows)
        return [texts.get(p, "") for p in passages]

    def counts(self) -> dict[str, int]:
        """Files, contents and passages in the index; its bytes on disk (WAL included)."""
        with self.lock:
            count = {
                t: self.db.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                for t in ("files", "contents", "passages")
            }
        size = sum(
            Path(str(self.path) + s).stat().st_size
            for s in ("", "-wal")
            if Path(str(self.path) + s).exists()
        )
        return count | {"bytes": size}


@dataclass(frozen=True)
class Passages:
    """Passages of some contents: ids (P,), owners (P,) content ids, chars (P, 2), pages (P,)
    and vectors (P, dims) float16 unit rows (zeros where not embedded)."""

    ids: np.ndarray
    owners: np.ndarray
    chars: np.ndarray
    pages: np.ndarray
    vectors: np.ndarray


def cut(document: Document) -> list[tuple[int, int, int]]:
    """The document's passages: (first char, end char, page), runs of whole sentences of at
    least :data:`PASSAGE_WORDS` words (the last may be shorter), a sentence of more than
    :data:`PASSAGE_MAX_WORDS` words cut between words."""
    text = document.text
    out: list[tuple[int, int, int]] = []
    start, count = 0, 0
    ends = [*sentence_ends(text), len(text)]
    prev = 0
    for end in ends:
        n = len(words(text[prev:end]))
        if n > PASSAGE_MAX_WORDS:  # one long sentence: close the passage, then cut it
            if count:
                out.append((start, prev, document.page_of_char(start)))
            for a, b in _word_runs(text, prev, end):
                out.append((a, b, document.page_of_char(a)))
            start, count = end, 0
        else:
            count += n
            if count >= PASSAGE_WORDS:
                out.append((start, end, document.page_of_char(start)))
                start, count = end, 0
        prev = end
    if start < len(text) and text[start:].strip():
        out.append((start, len(text), document.page_of_char(start)))
    return [(a, b, p) for a, b, p in out if text[a:b].strip()]


def _word_runs(text: str, a: int, b: int) -> list[tuple[int, int]]:
    """[a, b) cut into runs of :data:`PASSAGE_WORDS` words (at white space)."""
    spaces = [m.end() for m in re.finditer(r"\s+", text[a:b])]
    cuts = [a + spaces[i] for i in range(PASSAGE_WORDS - 1, len(spaces), PASSAGE_WORDS)]
    bounds = [a, *[c for c in cuts if a < c < b], b]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def fts_terms(question: str) -> list[str]:
    """The question's words FTS5 looks for: lower-cased, function words left out, once each."""
    return list(dict.fromkeys(w for w in words(question) if w not in STOPWORDS))


def _unusable(path: Path, exc: sqlite3.Error) -> SekvError:
    return SekvError(
        f"cannot use the collection index {path} ({one_line(exc)}): another sekv may be "
        "writing it for long, or its folder is read-only or full"
    )


def _stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino)
