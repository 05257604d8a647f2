"""Ingest on a Ray cluster: every document's span store built by a task on whichever node has
room, into one store folder every node sees.

The driver (this process) reads the selection, keeps the collection index (a collection is
synced with it here, as a local ingest does) and decides what must be read: a document whose
store is found is not sent. Each document to read goes to a task with its text and tokens
(nodes need not see the documents, only the store folder), and the task calls
:func:`sekv_core.ingest.open_or_build`, the function a local ingest calls: the same store, under
the same lock, written by the same atomic rename. A task's node loads the model once per worker
process (converted once per node, in that node's ``$SEKV_HOME``, as a local run does) and builds
into the driver's store folder (``$SEKV_STORES`` in the task), which must be the same folder on
every node (a shared file system mounted at one path).

Faults: a task whose worker dies (killed, out of memory, its node lost) is run again by Ray, at
most :data:`RETRIES` more times; a half-written store is never renamed into place, and what a
dead writer left is removed at the next build (:mod:`sekv_core.locks`). A document that
fails on every try, or whose task raises, is skipped and counted, as an unreadable one is.
Ctrl-C cancels the tasks (their workers are killed); the stores finished stay.

Ray is an optional dependency (``pip install 'sekv[cluster]'``): without it,
:func:`require_ray` is the error that says so.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from .api import IngestProgress
from .collection import Selection, Skipped
from .config import MAX_TOKENS, StoreSettings
from .documents import Document, check_tokens, load_document
from .errors import SekvError, one_line
from .index.catalog import Catalog, Synced, SyncProgress
from .index.embedder import load_embedder
from .ingest import open_or_build, stored_manifest
from .models import LoadedModel, load_model
from .paths import STORES_ENV, stores_dir
from .prompt import Context, encode_context
from .threads import apply_threads

try:
    import ray
except ImportError:  # the optional extra is not installed
    ray = None

INSTALL = "pip install 'sekv[cluster]'"
RETRIES = 2  # runs of a document after its worker died, beyond the first
POLL_S = 0.5  # the driver's progress and results, this often
IN_FLIGHT = 2  # tasks sent per task slot of the cluster (a slot never waits for the driver)

Progress = Callable[[IngestProgress], None]


def require_ray() -> ModuleType:
    """The ``ray`` module; a SekvError saying what to install where it is missing."""
    if ray is None:
        raise SekvError(f"--cluster needs Ray, which is not installed; run: {INSTALL}")
    return ray


@contextmanager
def connected(address: str) -> Iterator[None]:
    """Ray connected to the cluster at ``address`` (``local``: a cluster started on this
    machine for the block, stopped after it), disconnected after the block. A process already
    connected (``ray.init`` called by the caller) keeps its connection and uses it. Within the
    block standard output is standard error: Ray prints what its nodes report (a worker that
    died) on standard output, which holds data (``--json``)."""
    require_ray()
    with redirect_stdout(sys.stderr):
        if ray.is_initialized():
            yield
            return
        quiet = dict(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
        try:
            ray.init(address=None if address == "local" else address, **quiet)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise SekvError(
                f"cannot join the Ray cluster at {address!r} ({one_line(exc)}); start one "
                "with `ray start --head` and pass the address it prints, or --cluster local"
            ) from None
        try:
            yield
        finally:
            ray.shutdown()


@dataclass(frozen=True)
class Job:
    """What a task is given: one document, read and tokenised by the driver, and where and
    with which model (``model`` as the driver named it, ``fingerprint`` its weights') and
    settings its store is built."""

    index: int
    document: Document
    context: Context
    model: str | None
    fingerprint: str
    settings: StoreSettings
    stores: str
    threads: int


@dataclass(frozen=True)
class Read:
    """What a task returns: its document's store (found or built), where it ran (node address,
    host name, process) and how long the store took (``model_s``: loading the model first, in
    a worker that had not yet), with the warnings the build gave."""

    index: int
    store: str
    cache_hit: bool
    bytes: dict[str, int]
    node: str
    host: str
    pid: int
    seconds: float
    model_s: float
    warnings: list[str]


@dataclass
class Planned:
    """A document of the selection: its file, what it is, and its store once found or built
    (``read``: where and how it was built on the cluster; ``attempts``: its tasks' runs)."""

    index: int
    path: Path
    sha256: str = ""
    tokens: int = 0  # the document's
    context_tokens: int = 0  # the prompt's, document included: what a task prefills
    pages: int = 0
    full_kv_bytes: int = 0
    store: Path | None = None
    cache_hit: bool = False
    bytes: dict[str, int] | None = None
    read: Read | None = None
    attempts: int = 0

    def to_json(self) -> dict[str, Any]:
        b, r = self.bytes or {}, self.read
        return {
            "path": str(self.path),
            "sha256": self.sha256,
            "tokens": self.tokens,
            "pages": self.pages,
            "store": {"path": str(self.store), "cache_hit": self.cache_hit},
            "memory": {
                "full_kv_bytes": self.full_kv_bytes,
                "resident_bytes": b.get("resident", 0),
                "offloaded_bytes": b.get("offload_records", 0),
                "store_bytes": b.get("store", 0),
            },
            "node": None if r is None else r.node,
            "host": None if r is None else r.host,
            "seconds": None if r is None else round(r.seconds, 3),
            "model_s": None if r is None else round(r.model_s, 3),
            "attempts": self.attempts,
        }


@dataclass
class ClusterIngest:
    """What an ingest on a cluster did: every document with its store, those skipped (not
    readable, or failed on the cluster), the cluster's nodes and task slots, the tokens read
    on it and the seconds that took."""

    documents: list[Planned]
    skipped: list[Skipped]
    nodes: int
    slots: int
    threads: int
    tokens_read: int = 0
    read_s: float = 0.0
    synced: Synced | None = None  # the collection index's sync (a collection)

    @property
    def tokens_per_s(self) -> float:
        """Tokens prefilled on the cluster per second of wall time, all nodes together."""
        return self.tokens_read / self.read_s if self.read_s > 0 else 0.0

    def in_all(self) -> dict[str, int]:
        """The memory of every document's store: as :meth:`sekv_core.api.Library.memory`
        counts it when nothing is held."""
        rows = [d.to_json() for d in self.documents]
        return {
            "documents": len(rows),
            "tokens": sum(r["tokens"] for r in rows),
            "resident_bytes": 0,
            "resident_all_bytes": sum(r["memory"]["resident_bytes"] for r in rows),
            "full_kv_bytes": sum(r["memory"]["full_kv_bytes"] for r in rows),
        }


class Board:
    """Where tasks tell the driver how far they are (a Ray actor): each document's node,
    process and tokens prefilled, and how many times a task started on it."""

    def __init__(self) -> None:
        self.reading: dict[int, tuple[str, int, int]] = {}  # index -> (host, pid, tokens done)
        self.starts: dict[int, int] = {}

    def start(self, index: int, host: str, pid: int) -> None:
        self.reading[index] = (host, pid, 0)
        self.starts[index] = self.starts.get(index, 0) + 1

    def update(self, index: int, done: int) -> None:
        host, pid, _ = self.reading.get(index, ("", 0, 0))
        self.reading[index] = (host, pid, done)

    def finish(self, index: int) -> None:
        self.reading.pop(index, None)

    def snapshot(self) -> tuple[dict[int, tuple[str, int, int]], dict[int, int]]:
        return dict(self.reading), dict(self.starts)


_worker_model: tuple[tuple[str | None, int], LoadedModel] | None = None
"""The model this worker process loaded, kept for its next documents (Ray runs many tasks in
one worker process); one at a time."""


def worker_model(name: str | None, threads: int) -> tuple[LoadedModel, float]:
    """The model ``name`` in this worker process at ``threads`` threads, loaded if it is not
    yet (seconds that took, else 0)."""
    global _worker_model
    if _worker_model is not None and _worker_model[0] == (name, threads):
        return _worker_model[1], 0.0
    _worker_model = None  # the one before goes first
    start = time.perf_counter()
    apply_threads(threads)
    loaded = load_model(name)
    _worker_model = ((name, threads), loaded)
    return loaded, time.perf_counter() - start


def read_on_node(job: Job, board: Any) -> Read:
    """A task: the store of ``job``'s document found or built on this node by
    :func:`sekv_core.ingest.open_or_build`, in the driver's store folder; ``board`` (a
    :class:`Board` actor) told of its progress."""
    host, pid = socket.gethostname(), os.getpid()
    node = ray.util.get_node_ip_address()
    board.start.remote(job.index, host, pid)
    if not Path(job.stores).is_dir():  # a folder made here would be seen by no other node
        raise SekvError(
            f"node {host} does not see the store folder {job.stores}; mount the shared folder "
            "at the same path on every node"
        )
    loaded, model_s = worker_model(job.model, job.threads)
    if loaded.fingerprint != job.fingerprint:
        raise SekvError(
            f"node {host} loads other weights for {job.model or 'the default model'} than the "
            "driver; install the same model on every node"
        )
    os.environ[STORES_ENV] = job.stores
    warnings: list[str] = []
    start = time.perf_counter()

    def progress(done: int, _total: int) -> None:
        board.update.remote(job.index, done)

    store, hit = open_or_build(
        loaded, job.document, job.context, job.settings, progress, warnings.append
    )
    seconds = time.perf_counter() - start
    board.finish.remote(job.index)
    bytes_ = dict(store.manifest["bytes"])
    return Read(
        job.index, str(store.path), hit, bytes_, node, host, pid, seconds, model_s, warnings
    )


def ingest_on_cluster(
    address: str,
    loaded: LoadedModel,
    model: str | None,
    selection: Selection,
    settings: StoreSettings | None = None,
    threads: int = 1,
    max_tokens: int | None = MAX_TOKENS,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
) -> ClusterIngest:
    """Find or build the store of every document ``selection`` names on the Ray cluster at
    ``address`` (see the module docstring): ``loaded`` is the model on the driver (its
    tokenizer and fingerprint), ``model`` its name as each node loads it (None: the default),
    ``threads`` each task's CPUs and torch threads. A collection is synced with the collection
    index first. ``progress`` is told of documents and tokens done over the cluster, ``warn``
    of each document skipped. Raises SekvError when Ray is missing, the cluster cannot be
    joined, or no document could be read."""
    require_ray()
    settings = settings or StoreSettings()
    skipped = list(selection.skipped)

    def skip(path: Path, reason: str) -> None:
        skipped.append(Skipped(path, reason))
        if warn:
            warn(f"skipped: {reason}")

    synced = None
    if selection.collection:
        synced = _sync_index(selection, progress, warn)
        paths = [f.path for f in synced.files if f.content is not None]
        for f in synced.files:
            if f.content is None:
                skip(f.path, f.error)
    else:
        paths = [selection.documents[0].path]
    planned = [Planned(i, p) for i, p in enumerate(paths)]
    first = None if selection.collection else selection.documents[0]

    def job(plan: Planned) -> Job:
        document = first if first is not None else load_document(plan.path, max_tokens)
        context = encode_context(loaded.tokenizer, loaded.template, document.text)
        plan.sha256, plan.pages = document.sha256, document.pages
        plan.tokens, plan.context_tokens = len(context) - context.doc_start, len(context)
        plan.full_kv_bytes = loaded.spec.kv_bytes(len(context), 2)
        if not _found(plan, loaded, document, context, settings):
            check_tokens(document, plan.tokens, max_tokens)
        model_name = None if model is None else _absolute(model)
        stores = str(stores_dir())
        return Job(plan.index, document, context, model_name, loaded.fingerprint, settings,
                   stores, threads)  # fmt: skip

    kept, todo = [], []
    for plan in planned:  # each read and tokenised: its store's key, and the work in all
        try:
            job(plan)
        except SekvError as exc:
            skip(plan.path, str(exc))
            continue
        kept.append(plan)
        if plan.store is None:
            todo.append(plan)
    result = ClusterIngest(kept, skipped, 0, 0, threads, synced=synced)
    if todo:  # every store found: the cluster is not joined
        with connected(address):
            result.nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
            _read_all(todo, job, result, progress, skip, warn)
    result.documents = [p for p in kept if p.store is not None]
    if not result.documents:
        raise SekvError("no document's store could be found or built; see the warnings above")
    return result


def _read_all(
    todo: list[Planned],
    job: Callable[[Planned], Job],
    result: ClusterIngest,
    progress: Progress | None,
    skip: Callable[[Path, str], None],
    warn: Callable[[str], None] | None,
) -> None:
    """Send ``todo``'s documents to the cluster, the longest first, at most
    :data:`IN_FLIGHT` per task slot at a time (each read and tokenised again as it is sent:
    the driver holds no more than that), and gather their stores into ``result``."""
    task = ray.remote(read_on_node).options(
        num_cpus=result.threads, max_retries=RETRIES, retry_exceptions=False
    )
    board = ray.remote(num_cpus=0)(Board).remote()
    ray.get(board.snapshot.remote())  # started: what a task tells it is not held back
    queue = deque(sorted(todo, key=lambda p: -p.context_tokens))
    total = sum(p.context_tokens for p in todo)
    pending: dict[Any, Planned] = {}
    finished = 0  # tokens of the documents done
    shown = 0  # tokens done as last reported: never less than before
    start = time.perf_counter()
    try:
        while queue or pending:
            result.slots = max(1, int(ray.cluster_resources().get("CPU", 1)) // result.threads)
            while queue and len(pending) < IN_FLIGHT * result.slots:
                plan = queue.popleft()
                try:
                    pending[task.remote(job(plan), board)] = plan
                except SekvError as exc:  # edited since, and now unreadable or too long
                    skip(plan.path, str(exc))
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=POLL_S)
            reading, starts = ray.get(board.snapshot.remote())
            for ref in ready:
                plan = pending.pop(ref)
                plan.attempts = starts.get(plan.index, 1)
                failure = _gather(ref, plan)
                if failure:
                    skip(plan.path, failure)
                    continue
                finished += plan.context_tokens
                messages = list(plan.read.warnings)
                if plan.attempts > 1:
                    messages.append(f"read {plan.attempts} times (a worker died reading it)")
                for message in messages if warn else ():
                    warn(f"{plan.path.name}: {message}")
            now = [p for p in pending.values() if p.index in reading]
            shown = max(shown, finished + sum(reading[p.index][2] for p in now))
            if progress and (queue or pending):
                label = now[0].path.name if len(now) == 1 else f"{len(now)} documents at once"
                label = label if now else "on the cluster"
                done = len(todo) - len(queue) - len(pending)
                progress(IngestProgress(label, done, len(todo), shown, total))
    except KeyboardInterrupt:
        for ref in pending:
            ray.cancel(ref, force=True)  # their workers killed: nothing half-written is kept
        raise
    result.read_s = time.perf_counter() - start
    result.tokens_read = finished
    if progress and todo:
        progress(IngestProgress("", len(todo), len(todo), total, total))


def _gather(ref: Any, plan: Planned) -> str | None:
    """Record ``ref``'s store in ``plan``; the reason it failed, if it did."""
    try:
        read: Read = ray.get(ref)
    except ray.exceptions.RayTaskError as exc:  # the task raised
        cause = exc.cause
        why = str(cause) if isinstance(cause, SekvError) else f"{type(cause).__name__}: {cause}"
        return one_line(why)
    except ray.exceptions.RayError as exc:  # its worker died on every try, or its node
        return f"'{plan.path}' failed on the cluster {plan.attempts} times ({type(exc).__name__})"
    store = Path(read.store)
    if not (store / "manifest.json").is_file():
        return (
            f"the store of '{plan.path}' was built on {read.host} but is not seen here "
            f"({store.parent} is not one folder shared by every node)"
        )
    plan.read, plan.store, plan.cache_hit, plan.bytes = read, store, read.cache_hit, read.bytes
    return None


def _found(
    plan: Planned,
    loaded: LoadedModel,
    document: Document,
    context: Context,
    settings: StoreSettings,
) -> bool:
    """Whether ``plan``'s store is there already with a manifest that describes it (recorded
    in ``plan``); its files are verified when it is loaded, and a damaged one rebuilt then."""
    found = stored_manifest(loaded, document, context, settings)
    if found is None:
        return False
    plan.store, manifest = found
    plan.cache_hit, plan.bytes = True, manifest["bytes"]
    return True


def _sync_index(
    selection: Selection, progress: Progress | None, warn: Callable[[str], None] | None
) -> Synced:
    """The collection's files synced with the collection index (read only when new or
    changed), as opening a library syncs them."""

    def told(p: SyncProgress) -> None:
        if progress is not None:
            progress(IngestProgress(p.name, p.done, p.total, p.chars_done, p.chars, "bytes"))

    with Catalog(warn=warn) as catalog:
        return catalog.sync(selection.files, selection.folders, load_embedder, MAX_TOKENS, told)


def _absolute(model: str) -> str:
    """``model`` as every node can load it: a local path made absolute (the nodes share it, as
    they share the store folder), a hub id as it is."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model
