"""The Python API: open a file, several files or a folder; ask; read the answer as data.

    from sekv_core.api import open_documents

    docs = open_documents("reports/")  # a file, several files or a folder
    answer = docs.ask("Who chairs the safety committee?")
    print(answer.answer, [(s["path"], s["page"]) for s in answer.sources])
    docs.ask("When does it meet?")  # answered from what is loaded: nothing is read again

The CLI (``sekv ask``, ``chat``, ``ingest``) is a thin layer over :class:`Library`.

A collection (a folder, or several files; :mod:`sekv_core.collection`) is kept in the
collection index (:mod:`sekv_core.index`): opening it reads only the files that are new or
changed. A question ranks the documents by words and meaning (:mod:`sekv_core.index.ranking`)
and is answered from the best :data:`READ_TOGETHER` read together in one softmax
(:func:`sekv_core.together.ask_together`); a document's span store is built the first time a
question is routed to it (``build_all``: when the library opens, as ``sekv ingest`` does) and
kept for later questions, at most ``keep`` sessions at a time (the least recently used goes).
Every source names its file and page. ``retrieve`` reads BM25 passages of the whole collection
instead; ``full`` answers from the best document alone.

A file edited on disk after the library read it is read again before the next question (one
warning says so). Libraries may be used from several threads: the calls on one model (shared
by every library it was passed to) are served one at a time (:attr:`LoadedModel.lock`).
Misused arguments raise TypeError or ValueError naming them, before any work is done.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .collection import Selection, Skipped, joined_document, none_read, select_documents
from .config import MAX_TOKENS, MethodSettings, check_int, check_question, check_settings
from .documents import Document, check_tokens, load_document
from .engine import MAX_NEW_TOKENS, Answer, AskOptions, Session
from .errors import ArgumentError, SekvError
from .index.catalog import Catalog, Indexed, Synced, SyncProgress
from .index.embedder import load_embedder
from .index.likelihood import QuestionLikelihood
from .index.ranking import Finder, Ranked
from .ingest import open_or_build, store_path, stored_manifest
from .methods import METHODS, SeKV
from .models import LoadedModel, load_model
from .prompt import Context, Turn, encode_context, encode_question
from .sources import in_documents
from .store.shelf import mark_used
from .together import NotTogether, ask_together

KEEP = 3  # routed documents whose sessions (and stores) stay loaded for later questions
READ_TOGETHER = 3  # the best documents a collection's answer reads at once
ROUTED = 5  # documents an answer's routing lists


@dataclass(frozen=True)
class IngestProgress:
    """Where opening a library stands: the document being read (``name``), documents read of
    those that need it (the others' stores are found), context tokens read of theirs
    (``unit``: what is counted instead of tokens)."""

    name: str
    documents_done: int
    documents: int
    tokens_done: int
    tokens: int
    unit: str = "tokens"  # "characters": a long document being tokenised; "bytes": indexing


Progress = Callable[[IngestProgress], None]


@dataclass
class Entry:
    """A document of a library: its file (``indexed``: as the collection index knows it), read
    and tokenised once a question needs it; with its store's place and sizes once found or
    built (methods that keep a span store)."""

    path: Path
    indexed: Indexed | None = None
    document: Document | None = None
    context: Context | None = None
    store: Path | None = None
    cache_hit: bool = False
    bytes: dict[str, int] | None = None  # the store manifest's sizes
    stamp: tuple[int, int] | None = None  # the file's (size, mtime_ns) when it was read

    @property
    def tokens(self) -> int | None:
        """The document's tokens (None: not read by this library)."""
        return None if self.context is None else len(self.context) - self.context.doc_start


def open_documents(
    paths: str | Path | Sequence[str | Path],
    model: str | LoadedModel | None = None,
    method: str = "sekv",
    settings: MethodSettings | None = None,
    progress: Progress | None = None,
    max_tokens: int | None = MAX_TOKENS,
    keep: int = KEEP,
    build_all: bool = False,
) -> Library:
    """Open the documents ``paths`` name, load ``model`` (None: the embedded default; a name or
    path, or a model loaded already) and prepare them for ``method``; see :class:`Library`.

    A document of a collection that cannot be read is skipped (``Library.skipped``) and
    ``settings.warn`` is told (default: :func:`warnings.warn`). Raises SekvError for a file
    named alone that cannot be read and for a selection with no readable document, TypeError
    or ValueError for a misused argument (before anything is read or loaded).
    """
    settings = MethodSettings(warn=_python_warning) if settings is None else settings
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not isinstance(paths, Sequence) or not all(isinstance(p, (str, Path)) for p in paths):
        raise TypeError(f"paths must be a path, or a sequence of paths, not {paths!r:.60}")
    named = list(paths)
    if any(str(p) == "" for p in named):
        raise ArgumentError("paths holds an empty path; name a file or a folder")
    if model is not None and not isinstance(model, (str, Path, LoadedModel)):
        raise TypeError(f"model must be a name, a path or a LoadedModel, not {model!r:.60}")
    check_options(method, settings, progress, max_tokens, keep)
    selection = select_documents(named, max_tokens, settings.warn)
    if isinstance(model, LoadedModel):
        loaded = model
    else:
        loaded = load_model(None if model is None else str(model))
    return Library(loaded, selection, method, settings, progress, max_tokens, keep, build_all)


class Library:
    """The documents of ``selection`` prepared for ``method``: :meth:`ask` answers questions.

    One file named alone is prepared as a session over it when the library opens (its store
    built or found). A collection is synced with the collection index when it opens
    (``progress`` over the files read now); its documents are read, and their stores built,
    when a question is routed to them (``build_all``: every store when it opens).
    ``max_tokens``: a document of more tokens without a store is refused (in a collection:
    skipped). ``keep``: sessions held at once. ``catalog``: the collection index (default:
    ``$SEKV_HOME``'s). Calls from several threads, and from every library on the same loaded
    model, are served one at a time (:attr:`lock` is the model's). A file edited on disk
    since it was read is read again before the next question (``settings.warn`` is told).
    :meth:`close` (or leaving a ``with`` block) lets go of the stores held.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        selection: Selection,
        method: str = "sekv",
        settings: MethodSettings | None = None,
        progress: Progress | None = None,
        max_tokens: int | None = MAX_TOKENS,
        keep: int = KEEP,
        build_all: bool = False,
        catalog: Catalog | None = None,
    ) -> None:
        settings = MethodSettings() if settings is None else settings
        check_options(method, settings, progress, max_tokens, keep)
        self.loaded, self.method, self.settings = loaded, method, settings
        self.collection = selection.collection
        self.skipped: list[Skipped] = list(selection.skipped)
        self.left_out = selection.left_out  # what the folders' walk passed over, unread
        self.keep = keep
        self.max_tokens = max_tokens
        self.progress = progress
        self.lock: threading.RLock = loaded.lock  # the model's: one caller at a time
        self.closed = False
        self.stored = issubclass(METHODS[method], SeKV)  # answers from span stores
        self.sessions: OrderedDict[int, Session] = OrderedDict()  # least recently used first
        self.catalog: Catalog | None = None
        self.finder: Finder | None = None
        self.ranked: tuple[str, list[Ranked]] | None = None  # the last question's ranking
        self.joined: Session | None = None  # a collection's retrieve: one session over all
        self.joined_from: list[Document] = []  # the documents it joins, in order
        self.answered: Session | None = None  # the session of the last answer (its first)
        self.index_s = 0.0  # seconds the collection index took to open and sync
        self.synced: Synced | None = None  # what opening did to the index (a collection)
        with self.lock:
            if not self.collection:
                self.entries = self._read_alone(selection.documents[0], progress)
                self._session(0, progress)
                return
            self.entries = self._index(selection, catalog, progress)
            if method == "retrieve":
                self._join()
            elif self.stored and build_all:
                self.build_stores(progress)

    def close(self) -> None:
        """Let go of the sessions held (their stores and memory), the collection index and
        the last ranking; asking again raises ValueError. Closing again does nothing."""
        with self.lock:
            self.closed = True
            self.sessions.clear()
            self.joined = self.answered = self.finder = self.ranked = None
            if self.catalog is not None:
                self.catalog.close()
                self.catalog = None

    def __enter__(self) -> Library:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ask(self, question: str, max_new_tokens: int = MAX_NEW_TOKENS, **options: Any) -> Answer:
        """Answer ``question`` (:meth:`answer`) under ``AskOptions(max_new_tokens, **options)``:
        ``on_text``, ``sampling``, ``stop``, ``history``, ``allow_repeats``, ``forcing``.
        Raises TypeError or ValueError for a misused argument."""
        return self.answer(question, AskOptions(max_new_tokens, **options))

    def answer(self, question: str, options: AskOptions) -> Answer:
        """Answer ``question`` as ``options`` say (see :meth:`sekv_core.engine.Session.answer`):
        in a collection from the documents it ranks first, read together. Each source carries
        its document's ``path``; a collection's answer lists the documents ranked first and why
        (``routing["documents"]``), adds ``route_s`` to its timings and the memory of the
        stores held to its memory. Raises TypeError or ValueError for a misused question."""
        check_question(question)
        with self.lock:
            self._check_open()
            self.read_changed()
            start = time.perf_counter()
            ranking = self.rank(question)
            route_s = time.perf_counter() - start
            sessions = self.sessions_for(question, ranking)
            self.answered = sessions[0]
            answer = None
            if len(sessions) > 1:
                try:
                    answer = ask_together(sessions, question, options)
                except NotTogether:
                    sessions = sessions[:1]
            if answer is None:
                answer = sessions[0].answer(question, options)
                if sessions[0] is self.joined:  # its passages' files
                    in_documents(answer.sources, self.joined_from, answer.answer)
                for source in answer.sources:
                    source.setdefault("path", answer.document["path"])
            if self.collection:
                self._collection_facts(answer, ranking, route_s, sessions)
            return answer

    def rank(self, question: str) -> list[Ranked]:
        """The collection's documents for ``question``, best first (empty: one file alone)."""
        if not self.collection:
            return []
        with self.lock:
            self._check_open()
            if self.finder is None:
                files = [e.indexed for e in self.entries]
                read = READ_TOGETHER if self.stored else 1  # the model reads the best
                reader = None  # passages again when it picks which documents are read
                if len(files) > read and self.joined is None:  # (retrieve reads them all)
                    reader = QuestionLikelihood(self.loaded.model, self.loaded.tokenizer)
                self.finder = Finder(self.catalog, files, load_embedder(), reader)
                self.ranked = None
            if self.ranked is None or self.ranked[0] != question:  # a chat ranks it twice
                self.ranked = (question, self.finder.rank(question))  # (room, then ask)
            return self.ranked[1]

    def sessions_for(self, question: str, ranking: list[Ranked] | None = None) -> list[Session]:
        """The sessions ``question`` is answered from, the best first: a collection's best
        :data:`READ_TOGETHER` documents (read and their stores built if need be) for SeKV, the
        best one for the other methods."""
        with self.lock:
            self._check_open()
            if self.joined is not None:
                return [self.joined]
            if not self.collection:
                return [self._session(0)]
            ranking = self.rank(question) if ranking is None else ranking
            count = READ_TOGETHER if self.stored else 1
            chosen = [r.index for r in ranking[:count]] or [0]
            sessions = [self._session(i, self.progress) for i in chosen]
            while len(self.sessions) > max(self.keep, len(chosen)):  # least recently used
                self.sessions.pop(next(i for i in self.sessions if i not in chosen))
            return sessions

    def session_for(self, question: str, ranking: list[Ranked] | None = None) -> Session:
        """The session that answers ``question`` first (the best document's)."""
        return self.sessions_for(question, ranking)[0]

    def room(self, question: str = "") -> int:
        """Window tokens left for the question part and the answer in the sessions
        ``question`` goes to (a chat keeps its earlier turns within it)."""
        with self.lock:
            self._check_open()
            self.read_changed()
            return min(s.room() for s in self.sessions_for(question))

    def question_ids(self, question: str, history: Sequence[Turn] = ()) -> list[int]:
        """The question part of the prompt: ``history``'s turns, then ``question``."""
        with self.lock:  # the tokenizer is the model's
            return encode_question(self.loaded.tokenizer, self.loaded.template, question, history)

    def read_changed(self) -> list[Path]:
        """Read again the files edited on disk since this library read them (their size or
        time changed, and their bytes), telling ``settings.warn`` of each: their sessions go
        (a store is built or found for the new text when a question needs it) and a
        collection's index reads them again. A file gone, or one only touched, is answered
        from what was read. Returns the files read again (:meth:`ask` and :meth:`room` call
        it before each question)."""
        with self.lock:
            self._check_open()
            moved = []
            for i, entry in enumerate(self.entries):
                stamp = file_stamp(entry.path)
                if stamp is not None and stamp != entry.stamp:
                    moved.append((i, stamp))
            if not moved:
                return []
            if self.collection:
                changed = self._sync_changed(moved)
            else:
                changed = self._read_alone_again(moved[0][1])
            if changed and self.joined is not None:
                self._join()
            return changed

    def documents(self) -> list[dict[str, Any]]:
        """Each document: path, sha256, tokens (None: not read by this library), words,
        pages, its ``store`` (path, whether it was found rather than built; None: none yet, or
        a method without one), ``memory`` (the store's resident and offloaded bytes, its bytes
        on disk, the document's fp16 full KV; what is known) and whether its session is
        ``held`` now."""
        with self.lock:
            return [self._row(i, e) for i, e in enumerate(self.entries)]

    def _row(self, i: int, e: Entry) -> dict[str, Any]:
        """:meth:`documents`' row of entry ``i``, ``e``."""
        doc, b, ix = e.document, e.bytes or {}, e.indexed
        memory = {}
        if e.context is not None:
            memory["full_kv_bytes"] = self.loaded.spec.kv_bytes(len(e.context), 2)
        if e.bytes is not None:
            memory |= {
                "resident_bytes": b["resident"],
                "offloaded_bytes": b["offload_records"],
                "store_bytes": b["store"],
            }
        return {
            "path": str(e.path),
            "sha256": doc.sha256 if doc is not None else ix.sha256,
            "tokens": e.tokens,
            "words": ix.words if ix is not None else None,
            "pages": doc.pages if doc is not None else ix.pages,
            "store": None if e.store is None else {"path": str(e.store), "cache_hit": e.cache_hit},
            "memory": memory,
            "held": i in self.sessions,
        }

    def memory(self) -> dict[str, int]:
        """The library's memory in all: ``resident_bytes`` the sessions held now keep resident
        between answers (a span store's resident tier; a full cache), ``resident_all_bytes``
        what every store known would take at once, ``full_kv_bytes`` the fp16 full KV cache of
        every document read, and the ``tokens`` of those."""
        with self.lock:
            held = list(self.sessions.values()) + ([self.joined] if self.joined else [])
            rows = self.documents()
            return {
                "documents": len(rows),
                "tokens": sum(r["tokens"] or 0 for r in rows),
                "resident_bytes": sum(_between_answers(s) for s in held),
                "resident_all_bytes": sum(r["memory"].get("resident_bytes", 0) for r in rows),
                "full_kv_bytes": sum(r["memory"].get("full_kv_bytes", 0) for r in rows),
            }

    def to_json(self, answer: Answer) -> dict[str, Any]:
        """``answer`` as the CLI's ``--json`` prints it: a collection's with its ``documents``,
        ``skipped`` documents and memory ``in_all``."""
        out = answer.to_json()
        if self.collection:
            out["documents"] = self.documents()
            out["skipped"] = [s.to_json() for s in self.skipped]
            out["in_all"] = self.memory()
        return out

    def build_stores(self, progress: Progress | None = None) -> None:
        """Find every document's store, building those missing (or stale) one after the other
        (``sekv ingest``); a store is loaded to be built, then let go. A document that cannot
        be read now, or is too long without a store, is skipped."""
        with self.lock:
            self._check_open()
            readable = []
            for i, entry in enumerate(self.entries):
                try:
                    self._document(i)
                    readable.append(entry)
                except SekvError as exc:
                    self._skip(entry.path, str(exc))
            if len(readable) < len(self.entries):  # sessions and finder follow the entries
                self.entries, self.finder = readable, None
                self.sessions.clear()
            todo = [e for e in self.entries if e.context is not None and not self._found(e)]
            warn = self.settings.warn
            total = sum(len(e.context) for e in todo)
            done = 0
            for k, entry in enumerate(todo):
                name = entry.path.name

                def report(d: int, _t: int, name: str = name, k: int = k, at: int = done) -> None:
                    if progress:
                        progress(IngestProgress(name, k, len(todo), at + d, total))

                report(0, 0)
                store, entry.cache_hit = open_or_build(
                    self.loaded, entry.document, entry.context, self.settings.store, report, warn
                )
                entry.store, entry.bytes = store.path, store.manifest["bytes"]
                del store
                done += len(entry.context)
            if progress and todo:
                progress(IngestProgress("", len(todo), len(todo), total, total))

    def _read_alone(self, document: Document, progress: Progress | None) -> list[Entry]:
        """A file named alone, tokenised (characters reported to ``progress`` when long); over
        ``max_tokens`` without a store it is refused."""
        entry = Entry(document.path, stamp=file_stamp(document.path))
        self._tokenise(entry, document, progress)
        return [entry]

    def _tokenise(self, entry: Entry, document: Document, progress: Progress | None = None) -> None:
        """``entry`` holds ``document`` (read now), tokenised (characters reported to
        ``progress`` when long); over ``max_tokens`` without a store it is refused (and let
        go of). What was known of its store is forgotten: found again when needed."""
        told = None
        if progress is not None:
            name = document.path.name

            def told(done: int, total: int) -> None:
                progress(IngestProgress(name, 0, 1, done, total, "characters"))

        context = encode_context(self.loaded.tokenizer, self.loaded.template, document.text, told)
        entry.document, entry.context = document, context
        entry.store, entry.cache_hit, entry.bytes = None, False, None
        try:
            check_tokens(document, entry.tokens, self.max_tokens)
        except SekvError:
            if not self._stored_already(entry):  # a store built already: nothing left to read
                entry.document = entry.context = None  # read again when next needed
                raise

    def _read_alone_again(self, stamp: tuple[int, int]) -> list[Path]:
        """The file named alone, read again now its stamp is ``stamp`` (an error if it cannot
        be read now, the next question tries again)."""
        entry = self.entries[0]
        document = load_document(entry.path, self.max_tokens)
        if document.sha256 == entry.document.sha256:
            entry.stamp = stamp
            return []  # touched, not changed
        self._let_go(0)
        fresh = Entry(entry.path, stamp=stamp)
        self._tokenise(fresh, document)  # refused (too long): the next question tries again
        self.entries[0] = fresh
        return [fresh.path]

    def _sync_changed(self, moved: list[tuple[int, tuple[int, int]]]) -> list[Path]:
        """Sync the collection's entries ``moved`` (index, new stamp) with the index: those
        whose bytes changed are let go of, to be read when a question needs them; those that
        cannot be read now are skipped."""
        synced = self.catalog.sync(
            [self.entries[i].path for i, _ in moved], (), load_embedder, MAX_TOKENS
        )
        changed, unreadable = [], set()
        for (i, stamp), indexed in zip(moved, synced.files, strict=True):
            entry = self.entries[i]
            entry.stamp = stamp
            if indexed.sha256 == entry.indexed.sha256:
                continue  # touched, not changed
            self._let_go(i)
            changed.append(entry.path)
            self.entries[i] = Entry(entry.path, indexed, stamp=stamp)
            if indexed.content is None:
                self._skip(entry.path, indexed.error)
                unreadable.add(i)
        if unreadable:  # the entries after them move up; so do their sessions
            kept = [i for i in range(len(self.entries)) if i not in unreadable]
            if not kept:
                raise SekvError("none of the documents can be read now")
            self.entries = [self.entries[i] for i in kept]
            at = {old: new for new, old in enumerate(kept)}
            self.sessions = OrderedDict((at[i], s) for i, s in self.sessions.items())
        if changed:
            self.finder = self.ranked = None  # ranked again over the new text
        return changed

    def _let_go(self, index: int) -> None:
        """Document ``index`` changed on disk: say so, and let its session go."""
        if self.settings.warn:
            self.settings.warn(f"{self.entries[index].path.name} changed on disk; reading it again")
        self.sessions.pop(index, None)

    def _join(self) -> None:
        """A collection's retrieve: one session over every document (read if need be)."""
        documents = [self._document(i) for i in range(len(self.entries))]
        joined = joined_document(documents)
        self.joined = Session(self.loaded, joined, self.method, self.settings)
        self.joined_from = documents  # where its sources are placed

    def _check_open(self) -> None:
        if self.closed:
            raise ArgumentError("this Library is closed; open the documents again")

    def _index(
        self, selection: Selection, catalog: Catalog | None, progress: Progress | None
    ) -> list[Entry]:
        """Sync the collection's files with the index; the files it could not read skipped."""
        start = time.perf_counter()
        self.catalog = catalog or Catalog(warn=self.settings.warn)
        stamps = [file_stamp(Path(p)) for p in selection.files]  # before the index reads them

        def told(p: SyncProgress) -> None:
            if progress is not None:
                progress(IngestProgress(p.name, p.done, p.total, p.chars_done, p.chars, "bytes"))

        # the index reads what any run could (the default limit): --max-tokens applies when a
        # document is read for an answer, so an index entry never depends on it
        synced = self.catalog.sync(
            selection.files, selection.folders, load_embedder, MAX_TOKENS, told
        )
        entries = []
        for f, stamp in zip(synced.files, stamps, strict=True):
            if f.content is None:
                self._skip(f.path, f.error)
            else:
                entries.append(Entry(f.path, f, stamp=stamp))
        self.synced = synced
        self.index_s = time.perf_counter() - start
        if not entries:
            named = selection.folders or selection.files
            where = ", ".join(f"'{p}'" for p in named[:3]) + (", …" if len(named) > 3 else "")
            raise SekvError(none_read(len(self.skipped), where))
        return entries

    def _document(self, index: int) -> Document:
        """Document ``index``, read and tokenised (once); a file edited since it was indexed
        is read as it is now."""
        entry = self.entries[index]
        if entry.document is None:
            self._tokenise(entry, load_document(entry.path, self.max_tokens))
        return entry.document

    def _stored_already(self, entry: Entry) -> bool:
        if not self.stored:
            return False
        return store_path(self.loaded, entry.document, entry.context, self.settings.store).exists()

    def _skip(self, path: Path, reason: str) -> None:
        self.skipped.append(Skipped(path, reason))
        if self.settings.warn:
            self.settings.warn(f"skipped: {reason}")

    def _found(self, entry: Entry) -> bool:
        """Whether ``entry``'s store is on disk with a manifest that describes it (its files
        are verified when it is loaded; a damaged one is rebuilt then)."""
        found = stored_manifest(self.loaded, entry.document, entry.context, self.settings.store)
        if found is None:
            return False
        entry.store, manifest = found
        mark_used(entry.store)
        entry.cache_hit, entry.bytes = True, manifest["bytes"]
        return True

    def _session(self, index: int, progress: Progress | None = None) -> Session:
        """Document ``index``'s session, prepared if it is not held (:meth:`sessions_for` lets
        the least recently used go past ``keep``)."""
        if index in self.sessions:
            self.sessions.move_to_end(index)
            return self.sessions[index]
        self._document(index)
        entry = self.entries[index]
        name = entry.path.name

        def report(done: int, total: int) -> None:
            if progress:
                progress(IngestProgress(name, 0, 1, done, total))

        if self.collection and self.stored and not self._found(entry):
            entry.cache_hit = False
        session = Session(
            self.loaded, entry.document, self.method, self.settings, report, context=entry.context
        )
        if isinstance(session.method, SeKV):
            entry.store = session.method.store.path
            entry.cache_hit = session.method.cache_hit
            entry.bytes = session.method.store.manifest["bytes"]
        self.sessions[index] = session
        return session

    def _collection_facts(
        self, answer: Answer, ranking: list[Ranked], route_s: float, sessions: list[Session]
    ) -> None:
        """A collection answer's routing (the documents ranked first and why), timings and
        memory."""
        answer.routing["documents"] = [
            {
                "path": str(self.entries[r.index].path),
                **r.to_json(),
                "passage": self.catalog.passage_text(r.passage),
            }  # fmt: skip
            for r in ranking[:ROUTED]
        ]
        answer.routing["read_together"] = [s.document_info()["path"] for s in sessions]
        if ranking:
            answer.timings["route_s"] = round(route_s, 4)
            for key in ("total_s", "first_token_s"):
                answer.timings[key] = round(answer.timings[key] + route_s, 4)
        for session in sessions:
            if isinstance(session.method, SeKV):  # its zoom is over: the pools go
                session.method.spans.drop_pools()
        in_all = self.memory()  # the answering stores counted with their zoom's peak
        held = in_all["resident_bytes"] - sum(_between_answers(s) for s in sessions)
        answer.memory["held_resident_bytes"] = held + answer.memory["resident_bytes"]
        answer.memory["collection_resident_bytes"] = in_all["resident_all_bytes"]
        answer.memory["collection_full_kv_bytes"] = in_all["full_kv_bytes"]


def check_options(
    method: str,
    settings: MethodSettings,
    progress: Progress | None,
    max_tokens: int | None,
    keep: int,
) -> None:
    """Raise TypeError or ValueError naming the first option of :func:`open_documents` (or
    :class:`Library`) that is misused."""
    if method not in METHODS:
        raise ArgumentError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    check_settings(settings)
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be callable or None, not {progress!r:.60}")
    if max_tokens is not None:
        check_int("max_tokens", max_tokens, 1)
    check_int("keep", keep, 1)


def file_stamp(path: Path) -> tuple[int, int] | None:
    """``path``'s (size, mtime_ns) now; None where it cannot be seen (gone)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def _between_answers(session: Session) -> int:
    """What ``session`` keeps resident between answers: its store's resident tier (its zoom
    pools are dropped after each answer of a collection), else all its method holds."""
    memory = session.method.memory()
    return memory.get("resident_tier_bytes", memory["resident_bytes"])


def _python_warning(message: str) -> None:
    warnings.warn(message, stacklevel=3)


__all__ = ["AskOptions", "IngestProgress", "Library", "open_documents"]
