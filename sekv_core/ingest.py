"""Ingest: the document's span store, loaded when a valid one exists, else built.

The only module that knows both builders: a context that fits the model window is built in one
prefill (:mod:`sekv_core.build`), a longer one is streamed (:mod:`sekv_core.stream`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .build import build_store
from .config import StoreSettings, exceeds_window
from .documents import Document
from .errors import SekvError
from .format import store_key
from .models import LoadedModel
from .paths import sekv_home
from .prefill import Progress
from .prompt import Context
from .store import SpanStore, StoreInvalid, load_store
from .stream import build_streamed


def store_path(
    loaded: LoadedModel, document: Document, context: Context, settings: StoreSettings
) -> Path:
    """Where the document's store for this model and these settings lives."""
    return sekv_home() / "stores" / store_key(loaded, document, context, settings)


def open_or_build(
    loaded: LoadedModel,
    document: Document,
    context: Context,
    settings: StoreSettings | None = None,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
) -> tuple[SpanStore, bool]:
    """Load the document's store if a valid one exists, else build it. Returns (store, cache_hit).

    A stale, foreign or corrupt store is rebuilt, and ``warn`` is told why.
    """
    settings = settings or StoreSettings()
    path = store_path(loaded, document, context, settings)
    if path.exists():
        try:
            return load_store(path, loaded, document, settings), True
        except StoreInvalid as exc:
            if warn:
                warn(f"rebuilding the span store at {path}: {exc}")
    try:
        if settings.stream.always or exceeds_window(loaded.spec.window, len(context)):
            build_streamed(path, loaded, document, context, settings, progress, warn)
        else:
            build_store(path, loaded, document, context, settings, progress)
    except OSError as exc:
        raise SekvError(
            f"cannot write the span store under {path.parent} ({exc.strerror or exc}); "
            "set SEKV_HOME to a writable directory with free space"
        ) from None
    return load_store(path, loaded, document, settings), False
