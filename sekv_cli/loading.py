"""Loading what a command works on: the model (torch's threads set, a spinner on stderr) and a
document's span store, with the checks that fail before the slow work (a writable
``$SEKV_HOME``, a document's tokens)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from rich.text import Text

from sekv_core.config import MAX_TOKENS, StoreSettings
from sekv_core.errors import SekvError
from sekv_core.paths import home_read_only, sekv_home
from sekv_core.threads import apply_threads

from .errors import warn
from .progress import TOKENIZING, prefill_progress, reading_notice
from .terminal import err, one_line


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


def open_store(file, model: str | None, threads: int, max_tokens: int = MAX_TOKENS):
    """Load document and model, then find or build the document's span store (progress on stderr).

    Returns (loaded, document, context, store, cache_hit, seconds).
    """
    import time

    from sekv_core.documents import load_document

    start = time.perf_counter()
    with reading_notice([Path(file)]):
        document = load_document(file, max_tokens)
    check_home(answering=True)
    from sekv_core.engine import check_window  # torch: only once the input is known to be usable
    from sekv_core.ingest import open_or_build
    from sekv_core.prompt import chat_template, encode_context

    loaded = load_model_quietly(model, threads)
    with prefill_progress(f"Ingesting {one_line(document.path.name)}") as progress:
        context = encode_context(
            loaded.tokenizer,
            chat_template(loaded.tokenizer),
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


def check_home(answering: bool = False) -> None:
    """Fail before the model loads if ``$SEKV_HOME`` (stores, routers, the default model's
    converted copy) cannot be written, rather than after a prefill. ``answering``: a read-only
    home that holds stores (a shared cache) is used as it is (:mod:`sekv_core.paths`: work
    that must write there fails when it comes to it)."""
    home = sekv_home()  # created if need be, else an error naming SEKV_HOME
    if answering and home_read_only() and _holds_stores(home):
        return
    for folder in (home, home / "stores"):
        try:
            if folder.is_dir():
                with tempfile.TemporaryFile(dir=folder):  # what os.access misses: root, read-only
                    pass
        except OSError:
            where = "" if folder == home else f" ({folder})"
            raise SekvError(
                f"SEKV_HOME {home} is not writable{where}; set SEKV_HOME to a writable directory"
            ) from None


def _holds_stores(home: Path) -> bool:
    try:
        return any((home / "stores").iterdir())
    except OSError:
        return False


def check_document_tokens(loaded, document, context, max_tokens: int, store_settings) -> None:
    """Refuse a document over ``max_tokens`` tokens before it is prefilled, unless its span
    store for ``store_settings`` is built already (nothing left to read)."""
    from sekv_core.documents import check_tokens
    from sekv_core.ingest import store_path

    tokens = len(context) - context.doc_start
    if tokens > max_tokens and not store_path(loaded, document, context, store_settings).exists():
        check_tokens(document, tokens, max_tokens)
