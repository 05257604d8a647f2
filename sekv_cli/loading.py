"""Opening what a command works on, with the checks that fail before the slow work (the
documents read, a writable ``$SEKV_HOME``, a document's tokens): the model (torch's threads set,
a spinner on stderr), then a :class:`sekv_core.api.Library` of the documents (``ask``, ``chat``,
``ingest``; progress on stderr: documents done and left, tokens, ETA; a summary of what was
skipped) or one document's span store (``ingest``, ``inspect``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rich.text import Text

from sekv_core.collection import left_out_phrase, select_documents
from sekv_core.config import MAX_TOKENS, MethodSettings, StoreSettings, check_question
from sekv_core.errors import SekvError
from sekv_core.paths import check_home
from sekv_core.threads import apply_threads

from .errors import warn
from .eta import Eta, ProgressLog
from .progress import TOKENIZING, prefill_progress, progress_bar, reading_notice
from .terminal import err, one_line
from .words import how_many

if TYPE_CHECKING:
    from sekv_core.api import IngestProgress, Library


def load_model_quietly(name: str | None, threads: int):
    """Set torch's CPU threads, then load the model with a spinner on stderr. Slow work it
    tells of (the default model's first conversion) shows in the spinner, or as a plain line
    where stderr is not a terminal."""
    from sekv_core.models import load_model

    apply_threads(threads)
    with err.status(Text(f"Loading {name or 'the default model'}…")) as status:

        def notice(message: str) -> None:
            if err.is_terminal:
                status.update(Text(f"{message}…"))
            else:
                err.print(Text(f"{message}…"), soft_wrap=True)

        return load_model(name, notice=notice)


def open_library(
    paths: list[Path],
    model: str | None,
    method: str,
    settings: MethodSettings,
    threads: int,
    question: str | None = None,
    max_tokens: int = MAX_TOKENS,
    verb: str = "Reading",
    build_all: bool = False,
) -> tuple[Library, float]:
    """Read the documents ``paths`` name (an unreadable one of a collection: a warning), check
    ``question`` and ``$SEKV_HOME``, load the model, then open the library for ``method``
    (progress on stderr, labelled ``verb``). Returns (library, seconds spent reading documents
    and loading the model). ``build_all``: every document's store now (``sekv ingest``)."""
    if any(str(p) == "" for p in paths):
        raise SekvError("the document path is empty; name a file or a folder (. for this one)")
    start = time.perf_counter()
    with reading_notice(paths):
        selection = select_documents(paths, max_tokens, warn)
    if question is not None:
        check_question(question)
    check_home(answering=True)
    from sekv_core.api import Library  # torch: only once the input is known to be usable

    loaded = load_model_quietly(model, threads)
    load_s = time.perf_counter() - start
    alone = None if selection.collection else one_line(selection.documents[0].path.name)
    with library_progress(verb, alone) as progress:
        library = Library(
            loaded, selection, method, settings, progress, max_tokens, build_all=build_all
        )
    if library.collection:
        say_opened(library, len(selection.files) + len(selection.skipped))
    return library, load_s


def say_opened(library: Library, named: int) -> None:
    """One stderr line: documents, how many the collection index read now (new or changed),
    stores built now and found; how many skipped; what the folders' walk left out."""
    rows = library.documents()
    line = how_many(len(rows), "document")
    if (synced := library.synced) is not None:
        now = synced.read + synced.followed
        line += f" ({how_many(now, 'file')} indexed now, {synced.unchanged} unchanged)"
    stores = [r["store"] for r in rows if r["store"] is not None]
    if stores:
        built = sum(not s["cache_hit"] for s in stores)
        tokens = sum(r["tokens"] or 0 for r in rows)
        line += (
            f"; stores: {built} read now, {len(stores) - built} found ({how_many(tokens, 'token')})"
        )
    if library.skipped:
        line += f"; {len(library.skipped)} of {named} skipped (unreadable, see above)"
    if passed := left_out_phrase(library.left_out):  # hidden files, $SEKV_HOME
        line += f"; {passed} skipped"
    err.print(Text(line), soft_wrap=True)


@contextmanager
def library_progress(
    verb: str, alone: str | None = None
) -> Iterator[Callable[[IngestProgress], None]]:
    """Progress of a library's ingest on stderr: a bar with the document being read, documents
    done and left, tokens of all, elapsed and ETA; plain log lines where stderr is not a
    terminal. The file ``alone`` named shows ``verb alone`` as a single file always has
    (:func:`sekv_cli.progress.prefill_progress`)."""
    if alone is not None:
        with prefill_progress(f"{verb} {alone}") as update:
            yield lambda p: update(p.tokens_done, p.tokens, p.unit)
        return
    etas: dict[str, Eta] = {}  # one per unit: indexing (bytes), then reading (tokens)

    def label(p: IngestProgress) -> str:
        left = p.documents - p.documents_done
        what = "Indexing" if p.unit == "bytes" else verb
        if not p.name:  # the last report: every document read
            return f"{what}: {p.documents} of {how_many(p.documents, 'document')} done"
        return f"{what} {one_line(p.name)} ({p.documents_done} of {p.documents} done, {left} left)"

    if not err.is_terminal:
        logs: dict[str, ProgressLog] = {}  # one per unit: its own elapsed time and ETA

        def update_log(p: IngestProgress) -> None:
            log = logs.setdefault(
                p.unit,
                ProgressLog(verb, lambda line: err.print(Text(line), soft_wrap=True)),
            )
            log.label, log.unit = label(p), p.unit
            log.update(p.tokens_done, p.tokens)

        yield update_log
        return
    with progress_bar() as bar:
        task = bar.add_task(verb, total=None, eta=None)

        def update_bar(p: IngestProgress) -> None:
            left = etas.setdefault(p.unit, Eta()).update(p.tokens_done, p.tokens)
            done, total = p.tokens_done, p.tokens
            bar.update(
                task, description=label(p), completed=done, total=total, eta=left, unit=p.unit
            )

        yield update_bar


def open_store(file, model: str | None, threads: int, max_tokens: int = MAX_TOKENS):
    """Load document and model, then find or build the document's span store (progress on stderr).

    Returns (loaded, document, context, store, cache_hit, seconds).
    """
    from sekv_core.documents import load_document

    start = time.perf_counter()
    with reading_notice([Path(file)]):
        document = load_document(file, max_tokens)
    check_home(answering=True)
    from sekv_core.engine import check_window  # torch: only once the input is known to be usable
    from sekv_core.ingest import open_or_build
    from sekv_core.prompt import encode_context

    loaded = load_model_quietly(model, threads)
    with prefill_progress(f"Ingesting {one_line(document.path.name)}") as progress:
        context = encode_context(
            loaded.tokenizer,
            loaded.template,
            document.text,
            lambda done, total: progress(done, total, TOKENIZING),
        )
        check_document_tokens(loaded, document, context, max_tokens, StoreSettings())
        check_window(loaded, document, context, books=True)  # books are streamed
        store, hit = open_or_build(
            loaded,
            document,
            context,
            progress=progress,
            warn=warn,
        )
    return loaded, document, context, store, hit, time.perf_counter() - start


def check_document_tokens(loaded, document, context, max_tokens: int, store_settings) -> None:
    """Refuse a document over ``max_tokens`` tokens before it is prefilled, unless its span
    store for ``store_settings`` is built already (nothing left to read)."""
    from sekv_core.documents import check_tokens
    from sekv_core.ingest import store_path

    tokens = len(context) - context.doc_start
    if tokens > max_tokens and not store_path(loaded, document, context, store_settings).exists():
        check_tokens(document, tokens, max_tokens)
