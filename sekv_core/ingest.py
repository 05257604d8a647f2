"""Ingest: the document's span store, loaded when a valid one exists, else built.

The only module that knows both builders: a context that fits the model window is built in one
prefill (:mod:`sekv_core.store.build`), a longer one is streamed
(:mod:`sekv_core.store.stream`), its chunks read through the zoom
(:class:`sekv_core.zoom.chunks.ZoomedChunks`): above both rooms, it hands the store's builder
the zoom's reader. One process builds a given store at a time
(:func:`sekv_core.locks.store_lock`); another that wants it waits, then loads what the
first built. What killed builders left behind is cleaned before a build
(`sekv_core.locks.clean_leftovers`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import StoreSettings, is_book
from .documents import Document
from .errors import SekvError
from .locks import STATE_VERSION, clean_leftovers, store_lock
from .models import LoadedModel
from .paths import home_read_only, read_only_error, stores_dir
from .prefill import Progress
from .prompt import Context
from .store.build import build_store
from .store.format import StoreSource
from .store.load import SpanStore, StoreInvalid, check_claims, load_store, read_manifest
from .store.shelf import mark_used
from .store.stream import build_streamed
from .zoom.chunks import ZoomedChunks


def store_path(
    loaded: LoadedModel, document: Document, context: Context, settings: StoreSettings
) -> Path:
    """Where the document's store for this model and these settings lives."""
    return stores_dir() / StoreSource(loaded, document, context, settings).key


def stored_manifest(
    loaded: LoadedModel, document: Document, context: Context, settings: StoreSettings
) -> tuple[Path, dict[str, Any]] | None:
    """The path and manifest of the document's store when one is there whose manifest
    describes it, else None (its files are verified when it is loaded; a damaged one is
    rebuilt then)."""
    source = StoreSource(loaded, document, context, settings)
    path = stores_dir() / source.key
    try:
        manifest = read_manifest(path)
        check_claims(manifest, source)
    except (StoreInvalid, OSError):
        return None
    return path, manifest


def open_or_build(
    loaded: LoadedModel,
    document: Document,
    context: Context,
    settings: StoreSettings | None = None,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
) -> tuple[SpanStore, bool]:
    """Load the document's store if a valid one exists, else build it. Returns (store, cache_hit).

    A stale, foreign or corrupt store is rebuilt, and ``warn`` is told why. A store that fails
    to load without the lock (missing, being replaced, damaged) is decided under it. The store's
    last use is recorded (:func:`sekv_core.store.shelf.mark_used`). In a read-only
    ``$SEKV_HOME`` a valid store is loaded and nothing is written; a missing or unusable one
    is a SekvError.
    """
    source = StoreSource(loaded, document, context, settings or StoreSettings())
    path = stores_dir() / source.key
    name = document.path.name
    if path.exists():
        try:
            store = load_store(path, source)
        except StoreInvalid as exc:
            if home_read_only():  # never used, and it cannot be rebuilt there
                why = f"the span store of {name} there is unusable ({exc})"
                raise read_only_error(why) from None
            # else replaced meanwhile, or damaged: checked again under the lock
        else:
            mark_used(path)  # its last use: what `sekv stores prune` goes by
            return store, True
    if home_read_only():  # checked before any lock file or prefill
        raise read_only_error(f"it holds no span store of {name}, and one cannot be built there")

    def waiting() -> None:
        if warn:
            warn(f"another sekv process is ingesting {name}; waiting for it to finish")

    try:
        with store_lock(path, waiting):
            store, hit = _load_or_build(path, source, progress, warn)
    except OSError as exc:
        raise SekvError(
            f"cannot write the span store under {path.parent} ({exc.strerror or exc}); "
            "set SEKV_HOME to a writable directory with free space"
        ) from None
    mark_used(path)
    return store, hit


def _load_or_build(
    path: Path,
    source: StoreSource,
    progress: Progress | None,
    warn: Callable[[str], None] | None,
) -> tuple[SpanStore, bool]:
    """Under the store's lock: the store another process just built, else a new build."""
    if path.exists():
        try:
            return load_store(path, source), True
        except StoreInvalid as exc:
            if warn:
                warn(f"rebuilding the span store at {path}: {exc}")
    clean_leftovers(path.parent, path, STATE_VERSION)
    settings, tokens = source.settings, len(source.context)
    if settings.stream.always or is_book(source.loaded.spec.window, tokens):
        build_streamed(path, source, ZoomedChunks, progress, warn)
    else:
        build_store(path, source, progress)
    return load_store(path, source), False
