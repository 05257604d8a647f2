"""The stores under ``$SEKV_HOME/stores``: listed, removed, pruned (no model needed).

Every directory there is a store — a span store (:mod:`sekv_core.store.format`) or a
block-baseline store (``blocks-*``) — or a work folder (:mod:`sekv_core.locks`): an
interrupted streamed build a rerun resumes (``.partial-*``, kind ``resumable``) or what a dead
writer left (kind ``leftover``); so is a ``.tmp-*`` folder in ``$SEKV_HOME/models`` (a model
conversion's, :func:`sekv_core.models.converted_gguf`). Folders a live process works in
are not listed. Manifests
are read as plain JSON (a damaged one is still listed, so it can be removed). A store's last
use is its directory's mtime: set when it is built and each time it is loaded
(:func:`mark_used`), never in the manifest (its digest covers it).

Removal is safe for a process reading the store: under the store's build lock (a build in
progress is never removed under its builder; such a store is reported busy and kept), the
directory is renamed to ``.trash-<key>-<pid>`` (a reader opening it now fails and rebuilds; one
killed here leaves a folder :func:`sekv_core.locks.clean_leftovers` removes), then deleted: a
process that has the files open or memory-mapped keeps reading them (POSIX unlink).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SekvError
from ..locks import WORK_PREFIXES, store_lock, work_folder_state
from ..paths import read_only, read_only_error, stores_path

MIN_PREFIX = 4  # a key prefix shorter than this matches nothing (``rm b`` removes no store)
SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


@dataclass(frozen=True)
class StoreEntry:
    """One store on disk, as its directory and manifest tell (None: not in the manifest)."""

    path: Path
    kind: str  # "span", "blocks", or a work folder's "resumable" or "leftover"
    document: str | None  # its absolute path at ingest (older stores: as given; a block
    # store: its span store's)
    sha256: str | None  # the document's
    model: str | None
    tokens: int | None  # the document's
    bytes: int  # every file in the directory
    last_used: float  # epoch seconds

    @property
    def key(self) -> str:
        return self.path.name

    @property
    def is_work(self) -> bool:
        """A work folder (an interrupted build's), not a store."""
        return self.kind in ("resumable", "leftover")

    def to_dict(self) -> dict[str, Any]:
        used = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.last_used))
        return {
            "key": self.key,
            "kind": self.kind,
            "document": self.document,
            "sha256": self.sha256,
            "model": self.model,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "last_used": used,
            "path": str(self.path),
        }


@dataclass
class Removal:
    """What :func:`remove` did: stores removed, and those kept because a build holds them."""

    removed: list[StoreEntry]
    busy: list[StoreEntry]

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self.removed)


def shelf_dir() -> Path:
    """Where the stores are (:func:`sekv_core.paths.stores_path`; not created: listing writes
    nothing)."""
    return stores_path()


def mark_used(store: Path, when: float | None = None) -> None:
    """Record that ``store`` was used at ``when`` (default: now); not in a read-only home."""
    if read_only(store.parent):
        return
    try:
        os.utime(store, None if when is None else (when, when))
    except OSError:
        pass


def list_stores(stores: Path | None = None) -> list[StoreEntry]:
    """Every store in ``stores`` (default :func:`shelf_dir`), most recently used first."""
    stores = stores or shelf_dir()
    dirs = _folders(stores) + [p for p in _folders(stores.parent / "models") if _converting(p)]
    found = [e for e in map(_entry, dirs) if e is not None]
    documents = {e.sha256: e.document for e in found if e.kind == "span" and e.document}
    by_prefix = {sha[:12]: doc for sha, doc in documents.items() if sha}
    found = [  # a block store's manifest names no path: its span store's, if there is one
        e if e.document or e.sha256 not in documents else _with_document(e, documents[e.sha256])
        for e in found
    ]
    found = [  # a work folder names its document by its key's first 12 digits of the sha256
        _with_document(e, by_prefix[_sha_prefix(e.key)])
        if e.is_work and not e.document and _sha_prefix(e.key) in by_prefix
        else e
        for e in found
    ]
    return sorted(found, key=lambda e: (-e.last_used, e.key))


def match(entries: list[StoreEntry], target: str) -> list[StoreEntry]:
    """The stores ``target`` names: a store's directory or key; a file (its path resolved
    against the working directory: the stores recorded for that path, and those of the file's
    present content, for every model and settings); else a key prefix of one store.
    SekvError when none, or when a prefix begins several keys (nothing is removed then)."""
    path = Path(target).expanduser()
    named = [e for e in entries if e.key == target]
    if not named and path.is_dir():
        named = [e for e in entries if e.path.resolve() == path.resolve()]
    if not named:
        named = _document_stores(entries, path)
    if not named and len(target) >= MIN_PREFIX and not path.exists():
        named = [e for e in entries if e.key.startswith(target)]
        if len(named) > 1:
            shown = ", ".join(f"{e.key} ({Path(e.document or '–').name})" for e in named[:5])
            more = f" and {len(named) - 5} more" if len(named) > 5 else ""
            raise SekvError(
                f"'{target}' begins {len(named)} store keys: {shown}{more}; give more of the "
                "key (`sekv stores list` shows them), or the document's path"
            )
    if not named:
        raise SekvError(
            f"no store matches '{target}' (a document's path, or a key from `sekv stores list`)"
        )
    return named


def _document_stores(entries: list[StoreEntry], path: Path) -> list[StoreEntry]:
    """The stores of the file at ``path``: those recorded for its absolute path, and those of
    its present content if it exists, with every store (and work folder) of those contents. A
    store recorded by an older sekv under a relative path is matched by content only (the
    directory it was relative to is unknown)."""
    absolute = Path(os.path.abspath(path))
    shas = {e.sha256 for e in entries if e.document and _same_path(e.document, absolute)}
    if path.is_file():
        shas.add(_file_sha256(path))
    shas.discard(None)  # a damaged manifest names no document
    prefixes = {sha[:12] for sha in shas if sha}
    return [  # a block store without its span store: named by the file it matched
        e if e.document else _with_document(e, str(absolute))
        for e in entries
        if e.sha256 in shas or (e.is_work and _sha_prefix(e.key) in prefixes)
    ]


def plan_prune(
    entries: list[StoreEntry],
    older_than: float | None = None,
    max_size: int | None = None,
    now: float | None = None,
) -> list[StoreEntry]:
    """The stores a prune removes: every leftover of a dead writer, those last used over
    ``older_than`` seconds ago, then the least recently used until the rest take at most
    ``max_size`` bytes."""
    now = time.time() if now is None else now
    by_age = sorted(entries, key=lambda e: (e.last_used, e.key))  # least recently used first
    old = [e for e in by_age if older_than is not None and e.last_used < now - older_than]
    doomed = [e for e in by_age if e.kind == "leftover" or e in old]
    if max_size is not None:
        total = sum(e.bytes for e in entries) - sum(e.bytes for e in doomed)
        for e in by_age:
            if total <= max_size:
                break
            if e not in doomed:
                doomed.append(e)
                total -= e.bytes
    return doomed


def remove(entries: list[StoreEntry]) -> Removal:
    """Remove ``entries``, each under its build lock (one being built is kept, as busy)."""
    if entries and read_only(entries[0].path.parent):
        raise read_only_error("its stores cannot be removed", "remove them where it is writable")
    done = Removal([], [])
    for entry in entries:
        if entry.is_work:  # a work folder: removed unless its process came back to it
            if work_folder_state(entry.path) is None:
                done.busy.append(entry)
            else:
                shutil.rmtree(entry.path, ignore_errors=True)
                done.removed.append(entry)
            continue
        try:
            with store_lock(entry.path, waiting=_refuse):
                if _discard(entry.path):
                    done.removed.append(entry)
        except _Busy:
            done.busy.append(entry)
        except OSError as exc:
            raise SekvError(f"cannot remove {entry.path} ({exc.strerror or exc})") from None
    return done


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number with an optional unit K, M, G or T (powers of 1024; ``2G``,
    ``500MB``, ``1.5GiB``, ``0``). ValueError if it is not one."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"{text!r} is not a size; use e.g. 500M or 2G")
    return int(float(m[1]) * SIZE_UNITS[m[2].lower()])


def parse_age(text: str) -> float:
    """Seconds in ``text``: a number with a unit s, m, h, d or w (``30d``, ``12h``). ValueError
    if it is not one."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"{text!r} is not an age; use e.g. 30d, 12h or 2w")
    return float(m[1]) * AGE_UNITS[m[2].lower()]


class _Busy(Exception):
    """The store's build lock is held by another process."""


def _refuse() -> None:
    """:func:`sekv_core.locks.store_lock`'s ``waiting``: do not wait for a build, skip it."""
    raise _Busy


def _discard(store: Path) -> bool:
    """Rename ``store`` aside, then delete it; False if it is gone already."""
    trash = store.with_name(f".trash-{store.name}-{os.getpid()}")
    shutil.rmtree(trash, ignore_errors=True)  # a dead process's of the same pid
    try:
        os.replace(store, trash)
    except FileNotFoundError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def _folders(parent: Path) -> list[Path]:
    """The directories in ``parent`` (none if it is missing), links left out."""
    try:
        return [p for p in parent.iterdir() if p.is_dir() and not p.is_symlink()]
    except FileNotFoundError:
        return []


def _converting(folder: Path) -> bool:
    """Whether ``folder`` in ``$SEKV_HOME/models`` is a model conversion's (or unpacking's)
    work folder: listed with the stores' (a dead writer's is a leftover `prune` removes)."""
    return folder.name.startswith(".tmp-")


def _sha_prefix(key: str) -> str:
    """The first 12 digits of the document's sha256 a (work folder's) key begins with."""
    for prefix in WORK_PREFIXES:
        key = key.removeprefix(prefix)
    return key[:12]


def _entry(path: Path) -> StoreEntry | None:
    """The entry of the store or work folder at ``path``; None if it vanished meanwhile or a
    live process works in it."""
    try:
        last_used = path.stat().st_mtime
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        state = work_folder_state(path) if path.name.startswith(WORK_PREFIXES) else "store"
    except FileNotFoundError:
        return None
    if state != "store":
        document = _checkpoint_document(path)
        work = StoreEntry(path, state or "", document, None, None, None, size, last_used)
        return None if state is None else work
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = None
    manifest = manifest if isinstance(manifest, dict) else {}
    doc, model = (_dict(manifest, k) for k in ("document", "model"))
    blocks = manifest.get("format") == "sekv-block-store" or path.name.startswith("blocks-")
    tokens = doc.get("tokens")
    if blocks:  # a block store records the context and the prompt head before the document
        context, head = doc.get("context_tokens"), doc.get("doc_start")
        tokens = context - head if isinstance(context, int) and isinstance(head, int) else None
    return StoreEntry(
        path=path,
        kind="blocks" if blocks else "span",
        document=_str(doc.get("path")),
        sha256=_str(doc.get("sha256")),
        model=_str(model.get("id")),
        tokens=tokens if isinstance(tokens, int) else None,
        bytes=size,
        last_used=last_used,
    )


def _checkpoint_document(work: Path) -> str | None:
    """The document an interrupted streamed build's checkpoint records (None: none there)."""
    try:
        record = json.loads((work / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return _str(record.get("document")) if isinstance(record, dict) else None


def _with_document(entry: StoreEntry, document: str) -> StoreEntry:
    return StoreEntry(**{**entry.__dict__, "document": document})


def _dict(manifest: dict[str, Any], key: str) -> dict[str, Any]:
    value = manifest.get(key)
    return value if isinstance(value, dict) else {}


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _same_path(recorded: str, absolute: Path) -> bool:
    """Whether the document path a manifest records names the file at ``absolute``: the same
    absolute path, or the same file through links. A relative path (an older sekv recorded
    the path as given) names nothing here."""
    if not os.path.isabs(recorded):
        return False
    if Path(recorded) == absolute:
        return True
    try:
        return Path(recorded).resolve() == absolute.resolve()
    except OSError:
        return False


def _file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes (:attr:`sekv_core.documents.Document.sha256`)."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise SekvError(f"cannot read '{path}' ({exc.strerror or exc})") from None
