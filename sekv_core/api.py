"""The Python API: open a file, several files or a folder; ask; read the answer as data.

    from sekv_core.api import open_documents

    docs = open_documents("reports/")  # a file, several files or a folder
    answer = docs.ask("Who chairs the safety committee?")
    print(answer.answer, [(s["path"], s["page"]) for s in answer.sources])
    docs.ask("When does it meet?")  # answered from what is loaded: nothing is read again

The CLI (``sekv ask``, ``chat``, ``ingest``) is a thin layer over :class:`Library`.

A collection (a folder, or several files; :mod:`sekv_core.collection`) keeps one span store per
document, built when the library opens (an unchanged document's store is found, not rebuilt). A
question is routed to the document whose passages match its words best
(:mod:`sekv_core.collection_router`) and answered from that document alone, through the same
:class:`~sekv_core.engine.Session` a single file uses; its store is loaded then and kept for
later questions, at most ``keep`` stores at a time (the least recently used goes). Every source
names its file and page. ``retrieve`` reads BM25 passages of the whole collection instead.
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .collection import Selection, Skipped, joined_document, select_documents
from .collection_router import ROUTED, CollectionRouter, Ranked
from .config import MAX_TOKENS, MethodSettings, check_question
from .documents import Document, check_tokens
from .engine import Answer, Session
from .errors import SekvError
from .methods import METHODS, SeKV
from .models import LoadedModel, load_model
from .prompt import Context, Turn, chat_template, encode_context, encode_question
from .sampling import Sampling
from .store.ingest import open_or_build, store_path
from .store.load import StoreInvalid, check_claims, read_manifest
from .store.shelf import mark_used

KEEP = 3  # routed documents whose sessions (and stores) stay loaded for later questions


@dataclass(frozen=True)
class IngestProgress:
    """Where opening a library stands: the document being read (``name``), documents read of
    those that need it (the others' stores are found), context tokens read of theirs."""

    name: str
    documents_done: int
    documents: int
    tokens_done: int
    tokens: int
    unit: str = "tokens"  # "characters": a long document being tokenised (its tokens unknown)


Progress = Callable[[IngestProgress], None]


@dataclass
class Entry:
    """A document of a library: read and tokenised; with its store's place and sizes once
    found or built (methods that keep a span store)."""

    document: Document
    context: Context
    store: Path | None = None
    cache_hit: bool = False
    bytes: dict[str, int] | None = None  # the store manifest's sizes

    @property
    def tokens(self) -> int:
        return len(self.context) - self.context.doc_start


def open_documents(
    paths: str | Path | Sequence[str | Path],
    model: str | LoadedModel | None = None,
    method: str = "sekv",
    settings: MethodSettings | None = None,
    progress: Progress | None = None,
    max_tokens: int | None = MAX_TOKENS,
    keep: int = KEEP,
) -> Library:
    """Read the documents ``paths`` name, load ``model`` (None: the embedded default; a name or
    path, or a model loaded already) and prepare them for ``method``; see :class:`Library`.

    A document of a collection that cannot be read is skipped (``Library.skipped``) and
    ``settings.warn`` is told (default: :func:`warnings.warn`). Raises SekvError for a file
    named alone that cannot be read and for a selection with no readable document.
    """
    settings = settings or MethodSettings(warn=_python_warning)
    named = [paths] if isinstance(paths, (str, Path)) else list(paths)
    selection = select_documents(named, max_tokens, settings.warn)
    loaded = model if isinstance(model, LoadedModel) else load_model(model)
    return Library(loaded, selection, method, settings, progress, max_tokens, keep)


class Library:
    """The documents of ``selection`` prepared for ``method``: :meth:`ask` answers questions.

    One file named alone is prepared as a session over it when the library opens (its store
    built or found). A collection's documents get their stores when it opens (``progress``
    over them all); their sessions are prepared when a question is routed to them.
    ``max_tokens``: a document of more tokens without a store is refused (in a collection:
    skipped). ``keep``: sessions held at once.
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
    ) -> None:
        if method not in METHODS:
            raise SekvError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
        self.loaded, self.method = loaded, method
        self.settings = settings or MethodSettings()
        self.collection = selection.collection
        self.skipped: list[Skipped] = list(selection.skipped)
        self.keep = max(1, keep)
        self.template = chat_template(loaded.tokenizer)
        self.stored = issubclass(METHODS[method], SeKV)  # answers from span stores
        self.entries = self._read(selection.documents, max_tokens, progress)
        self.sessions: OrderedDict[int, Session] = OrderedDict()  # least recently used first
        self.router: CollectionRouter | None = None
        self.joined: Session | None = None  # a collection's retrieve: one session over all
        self.last: int | None = None  # the document the last question went to
        self.answered: Session | None = None  # the session of the last answer
        if not self.collection:
            self._session(0, progress)
        elif method == "retrieve":
            joined = joined_document([e.document for e in self.entries])
            self.joined = Session(loaded, joined, method, self.settings)
        else:
            if self.stored:
                self._ingest(progress)
            self.router = CollectionRouter()
            for e in self.entries:
                self.router.add(e.document.text, e.context.offsets)

    def ask(
        self,
        question: str,
        max_new_tokens: int = 128,
        on_text: Callable[[str], None] | None = None,
        sampling: Sampling | None = None,
        stop: Sequence[str] = (),
        history: Sequence[Turn] = (),
        allow_repeats: bool = False,
    ) -> Answer:
        """Answer ``question`` (see :meth:`sekv_core.engine.Session.ask`): in a collection from
        the document it routes to. Each source carries its document's ``path``; a
        collection's answer lists the documents routing ranked first (``routing["documents"]``)
        and adds ``route_s`` to its timings and the memory of the stores held to its memory."""
        check_question(question)
        start = time.perf_counter()
        ranking = self.rank(question)
        route_s = time.perf_counter() - start
        session = self.answered = self.session_for(question, ranking)
        answer = session.ask(
            question, max_new_tokens, on_text, sampling, stop, history, allow_repeats
        )
        for source in answer.sources:
            source["path"] = answer.document["path"]
        if self.collection:
            self._collection_facts(answer, ranking, route_s)
        return answer

    def rank(self, question: str) -> list[Ranked]:
        """The collection's documents for ``question``, best first (empty: nothing to route)."""
        return self.router.rank(question) if self.router is not None else []

    def session_for(self, question: str, ranking: list[Ranked] | None = None) -> Session:
        """The session ``question`` is answered from (a collection's: prepared if need be).
        A question that shares no word with any document stays with the last document asked
        (a chat's follow-up), else goes to the first."""
        if self.joined is not None:
            return self.joined
        if not self.collection:
            return self._session(0)
        ranking = self.rank(question) if ranking is None else ranking
        best = ranking[0].index if ranking[0].score > 0 or self.last is None else self.last
        self.last = best
        return self._session(best)

    def room(self, question: str = "") -> int:
        """Window tokens left for the question part and the answer in the session ``question``
        goes to (a chat keeps its earlier turns within it)."""
        return self.session_for(question).room()

    def question_ids(self, question: str, history: Sequence[Turn] = ()) -> list[int]:
        """The question part of the prompt: ``history``'s turns, then ``question``."""
        return encode_question(self.loaded.tokenizer, self.template, question, history)

    def documents(self) -> list[dict[str, Any]]:
        """Each document: path, sha256, tokens, pages, its ``store`` (path, whether it was found
        rather than built; None for methods without one), ``memory`` (the store's resident and
        offloaded bytes, its bytes on disk, the document's fp16 full KV) and whether its
        session is ``held`` now."""
        out = []
        for i, e in enumerate(self.entries):
            doc, b = e.document, e.bytes or {}
            memory = {"full_kv_bytes": self.loaded.spec.kv_bytes(len(e.context), 2)}
            if e.bytes is not None:
                memory |= {
                    "resident_bytes": b["resident"],
                    "offloaded_bytes": b["offload_records"],
                    "store_bytes": b["store"],
                }
            out.append(
                {
                    "path": str(doc.path),
                    "sha256": doc.sha256,
                    "tokens": e.tokens,
                    "pages": doc.pages,
                    "store": None
                    if e.store is None
                    else {"path": str(e.store), "cache_hit": e.cache_hit},
                    "memory": memory,
                    "held": i in self.sessions,
                }
            )
        return out

    def memory(self) -> dict[str, int]:
        """The library's memory in all: ``resident_bytes`` the sessions held now keep resident
        between answers (a span store's resident tier; a full cache), ``resident_all_bytes``
        what every document's resident tier would take at once, ``full_kv_bytes`` every
        document's fp16 full KV cache, and the ``tokens`` of all."""
        held = list(self.sessions.values()) + ([self.joined] if self.joined else [])
        rows = self.documents()
        return {
            "documents": len(rows),
            "tokens": sum(r["tokens"] for r in rows),
            "resident_bytes": sum(_between_answers(s) for s in held),
            "resident_all_bytes": sum(r["memory"].get("resident_bytes", 0) for r in rows),
            "full_kv_bytes": sum(r["memory"]["full_kv_bytes"] for r in rows),
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

    def _read(
        self, documents: list[Document], max_tokens: int | None, progress: Progress | None = None
    ) -> list[Entry]:
        """Tokenise every document; one over ``max_tokens`` without a store is refused (in a
        collection: skipped with a warning). A file named alone reports the characters
        tokenised to ``progress`` (``unit`` ``characters``) when it is long."""
        entries = []
        for document in documents:
            told = None
            if progress is not None and not self.collection:
                name = document.path.name

                def told(done: int, total: int, name: str = name) -> None:
                    progress(IngestProgress(name, 0, 1, done, total, "characters"))

            context = encode_context(self.loaded.tokenizer, self.template, document.text, told)
            entry = Entry(document, context)
            try:
                if not self._stored_already(entry):
                    check_tokens(document, entry.tokens, max_tokens)
            except SekvError as exc:
                if not self.collection:
                    raise
                self._skip(document.path, str(exc))
                continue
            entries.append(entry)
        if not entries:
            raise SekvError(f"none of the {len(self.skipped)} documents could be read")
        return entries

    def _stored_already(self, entry: Entry) -> bool:
        return store_path(self.loaded, entry.document, entry.context, self.settings.store).exists()

    def _skip(self, path: Path, reason: str) -> None:
        self.skipped.append(Skipped(path, reason))
        if self.settings.warn:
            self.settings.warn(f"skipped: {reason}")

    def _ingest(self, progress: Progress | None) -> None:
        """Find every document's store, building those missing (or stale) one after the other;
        a store is loaded to be built, then let go."""
        todo = [e for e in self.entries if not self._found(e)]
        warn = self.settings.warn
        total = sum(len(e.context) for e in todo)
        done = 0
        for k, entry in enumerate(todo):
            name = entry.document.path.name

            def report(d: int, _t: int, name: str = name, k: int = k, before: int = done) -> None:
                if progress:
                    progress(IngestProgress(name, k, len(todo), before + d, total))

            report(0, 0)
            store, entry.cache_hit = open_or_build(
                self.loaded, entry.document, entry.context, self.settings.store, report, warn
            )
            entry.store, entry.bytes = store.path, store.manifest["bytes"]
            del store
            done += len(entry.context)
        if progress and todo:
            progress(IngestProgress("", len(todo), len(todo), total, total))

    def _found(self, entry: Entry) -> bool:
        """Whether ``entry``'s store is on disk with a manifest that describes it (its files
        are verified when it is loaded; a damaged one is rebuilt then)."""
        path = store_path(self.loaded, entry.document, entry.context, self.settings.store)
        try:
            manifest = read_manifest(path)
            check_claims(manifest, self.loaded, entry.document, entry.context, self.settings.store)
        except (StoreInvalid, OSError):
            return False
        mark_used(path)
        entry.store, entry.cache_hit, entry.bytes = path, True, manifest["bytes"]
        return True

    def _session(self, index: int, progress: Progress | None = None) -> Session:
        """Document ``index``'s session, prepared if it is not held (the least recently used
        let go first when ``keep`` are)."""
        if index in self.sessions:
            self.sessions.move_to_end(index)
            return self.sessions[index]
        while len(self.sessions) >= self.keep:
            self.sessions.popitem(last=False)
        entry = self.entries[index]
        name = entry.document.path.name

        def report(done: int, total: int) -> None:
            if progress:
                progress(IngestProgress(name, 0, 1, done, total))

        session = Session(
            self.loaded, entry.document, self.method, self.settings, report, context=entry.context
        )
        if isinstance(session.method, SeKV) and entry.bytes is None:  # built or found just now
            entry.store, entry.cache_hit = session.method.store.path, session.method.cache_hit
            entry.bytes = session.method.store.bytes
        self.sessions[index] = session
        return session

    def _collection_facts(self, answer: Answer, ranking: list[Ranked], route_s: float) -> None:
        """A collection answer's routing (the documents ranked first), timings and memory."""
        answer.routing["documents"] = [
            {"path": str(self.entries[r.index].document.path), "score": round(r.score, 3)}
            for r in ranking[:ROUTED]
        ]
        if ranking:
            answer.timings["route_s"] = round(route_s, 4)
            for key in ("total_s", "first_token_s"):
                answer.timings[key] = round(answer.timings[key] + route_s, 4)
        if isinstance(self.answered.method, SeKV):  # its zoom is over: the pools go
            self.answered.method.spans.drop_pools()
        in_all = self.memory()  # the answering store counted with its zoom's peak
        held = in_all["resident_bytes"] - _between_answers(self.answered)
        answer.memory["held_resident_bytes"] = held + answer.memory["resident_bytes"]
        answer.memory["collection_resident_bytes"] = in_all["resident_all_bytes"]
        answer.memory["collection_full_kv_bytes"] = in_all["full_kv_bytes"]


def _between_answers(session: Session) -> int:
    """What ``session`` keeps resident between answers: its store's resident tier (its zoom
    pools are dropped after each answer of a collection), else all its method holds."""
    memory = session.method.memory()
    return memory.get("resident_tier_bytes", memory["resident_bytes"])


def _python_warning(message: str) -> None:
    warnings.warn(message, stacklevel=3)


__all__ = ["IngestProgress", "Library", "open_documents"]
