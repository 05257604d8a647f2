"""Opening documents for `ask`, `chat` and `ingest`: the selection read and checked before the
model loads, then a :class:`sekv_core.api.Library` with its progress on stderr (documents done
and left, tokens, ETA) and a summary of what was skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.text import Text

from sekv_core.collection import left_out_phrase, select_documents
from sekv_core.config import MAX_TOKENS, MethodSettings, check_question
from sekv_core.errors import SekvError

from . import loading
from .errors import warn
from .eta import Eta, ProgressLog
from .progress import prefill_progress, progress_bar, reading_notice
from .terminal import err, one_line
from .words import how_many

if TYPE_CHECKING:
    from sekv_core.api import IngestProgress, Library


def document_path(value: str) -> Path | str:
    """A PATH argument as a Path; an empty one kept as "" (a Path would make it ".", the
    current folder) for :func:`open_library` to refuse."""
    return Path(value) if value else value


PATHS_ARGUMENT = typer.Argument(
    ...,
    help="A document (.pdf, .txt or .md), several, or a folder (read recursively).",
    metavar="PATH...",
    show_default=False,
    parser=document_path,
)


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
    loading.check_home(answering=True)
    from sekv_core.api import Library  # torch: only once the input is known to be usable

    loaded = loading.load_model_quietly(model, threads)
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
