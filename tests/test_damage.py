"""The damage drill: a damaged, forged, half-written or raced store is never used.

Each store file and the manifest is flipped, truncated, deleted, swapped with another
document's, or edited (with the digest left stale, or recomputed as a forger would): the next
open rebuilds with a warning naming why, and the rebuilt files are a fresh build's. ``kill -9``
at each stage of an ingest leaves nothing that loads, and the next ingest succeeds; two
concurrent ingests of one document build it once. Tiny random models, real files, real
processes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import build_tiny_model

from sekv_core.config import StoreSettings, override
from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.ingest import open_or_build, store_path
from sekv_core.locks import STATE_VERSION, clean_leftovers, mark_writer, store_lock
from sekv_core.methods import MethodSettings
from sekv_core.models import load_model
from sekv_core.prompt import chat_template, encode_context
from sekv_core.store.format import DIGEST, FILES, manifest_digest

TEXT = "\n\n".join(f"Room {i}: the {w} key opens locker {i * 7 % 31}." for i, w in enumerate("abc"))
OTHER = "\n\n".join(f"Shelf {i} holds {i * 3} blue jars and a red lid." for i in range(4))
# a book for a 512-token window (as tests/test_stream.py); the subprocesses read it the same way
BOOK_SET = [
    "prefill_chunk=64",
    "segment.min_len=8",
    "segment.max_len=32",
    "stream.window=96",
    "stream.budget=48",
    "stream.route_queries=8",
]
BOOK = override(StoreSettings(), BOOK_SET)
BOOK_TEXT = "\n\n".join(
    f"Section {i}. The vault on floor {i % 9} holds crate {i}." for i in range(48)
)


@pytest.fixture(scope="module")
def llama(tiny_model_dirs):
    return load_model(str(tiny_model_dirs["llama"]), device="cpu")


def prepare(loaded, path: Path, text: str):
    path.write_text(text)
    document = load_document(path)
    return document, encode_context(
        loaded.tokenizer, chat_template(loaded.tokenizer), document.text
    )


@pytest.fixture(scope="module")
def reference(llama, tmp_path_factory):
    """Two documents' stores, built once: name -> (document, context, store directory)."""
    root = tmp_path_factory.mktemp("damage-reference")
    old = os.environ.get("SEKV_HOME")
    os.environ["SEKV_HOME"] = str(root / "home")
    try:
        out = {}
        for name, text in (("doc", TEXT), ("other", OTHER)):
            document, context = prepare(llama, root / f"{name}.md", text)
            out[name] = (document, context, open_or_build(llama, document, context)[0].path)
        return out
    finally:
        if old is None:
            os.environ.pop("SEKV_HOME")
        else:
            os.environ["SEKV_HOME"] = old


def install(reference, name: str = "doc"):
    """The reference store of ``name`` copied where this test's open looks for it."""
    document, context, src = reference[name]
    dst = store_path_of(reference, name)
    shutil.copytree(src, dst)
    return document, context, dst


def store_path_of(reference, name: str) -> Path:
    return Path(os.environ["SEKV_HOME"]) / "stores" / reference[name][2].name


def edit(path: Path, keys: str, change, digest: bool) -> None:
    """Change the manifest value at ``keys`` (a/b/c); recompute the digest when ``digest``."""
    manifest = json.loads(path.read_text())
    *parents, last = keys.split("/")
    node = manifest
    for key in parents:
        node = node[key]
    node[last] = change(node[last])
    if digest:
        manifest[DIGEST] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest, indent=2))


def flip(path: Path, _other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path, _other: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def delete(path: Path, _other: Path) -> None:
    path.unlink()


def swap(path: Path, other: Path) -> None:
    shutil.copyfile(other / path.name, path)


DAMAGES = {"flip": flip, "truncate": truncate, "delete": delete, "swap": swap}
# what the rebuild warning names, per damage of a tensor file / of the manifest
TENSOR_REASONS = {
    "flip": "checksum mismatch",
    "truncate": "bytes, expected",
    "delete": "No such file",
    "swap": "bytes, expected|checksum mismatch",
}
MANIFEST_REASONS = {
    "flip": "manifest (unreadable|digest mismatch)",
    "truncate": "manifest unreadable",
    "delete": "No such file",
    "swap": "document.sha256",
}
EDITS = {  # key path: (change, what a forged manifest (digest recomputed) is caught by)
    "positions/mode": (lambda v: "bounded", "positions.mode"),
    "positions/sinks": (lambda v: v + 1, "positions.sinks"),
    "document/context_tokens": (lambda v: v + 1, "document.context_tokens"),
    "document/doc_start": (lambda v: v - 1, "document.doc_start"),
    "document/tokens": (lambda v: v - 1, "document.tokens"),
    "bytes/resident": (lambda v: v // 2, "bytes.resident"),
    "bytes/offloaded": (lambda v: v + 1, "bytes.offloaded"),
    "files/offload.safetensors/bytes": (lambda v: v - 1, "offload.safetensors is"),
    "files/trace.safetensors/sha256": (lambda v: "0" * 64, "trace.safetensors checksum"),
    "settings/sketch_bits": (lambda v: 8 if v != 8 else 4, "settings"),
}


def reopen_rebuilds(llama, reference, reason: str) -> None:
    """The next open warns ``reason`` (a regex), rebuilds, and the rebuilt files are a fresh
    build's; the open after that is a cache hit."""
    document, context, fresh = reference["doc"]
    warnings: list[str] = []
    store, hit = open_or_build(llama, document, context, warn=warnings.append)
    assert not hit and len(warnings) == 1, warnings
    assert "rebuilding the span store" in warnings[0]
    assert re.search(reason, warnings[0]), warnings[0]
    for name in FILES:
        assert (store.path / name).read_bytes() == (fresh / name).read_bytes(), name
    assert open_or_build(llama, document, context)[1]


@pytest.mark.parametrize("damage", sorted(DAMAGES))
@pytest.mark.parametrize("target", [*FILES, "manifest.json"])
def test_damaged_file_is_detected_and_rebuilt(llama, reference, target, damage):
    _, _, path = install(reference)
    DAMAGES[damage](path / target, reference["other"][2])
    reasons = MANIFEST_REASONS if target == "manifest.json" else TENSOR_REASONS
    reopen_rebuilds(llama, reference, reasons[damage])


@pytest.mark.parametrize("forged", [False, True], ids=["stale-digest", "forged-digest"])
@pytest.mark.parametrize("keys", sorted(EDITS))
def test_edited_manifest_value_is_detected_and_rebuilt(llama, reference, keys, forged):
    """An edit fails the digest; an edit with a recomputed digest fails the consistency checks
    of what the manifest claims against the document, context and stored tensors."""
    _, _, path = install(reference)
    change, caught_by = EDITS[keys]
    edit(path / "manifest.json", keys, change, digest=forged)
    reopen_rebuilds(llama, reference, caught_by if forged else "digest mismatch")


def test_an_answer_never_reads_a_forged_bounded_manifest(llama, reference):
    """The issue's case: "original" forged to "bounded" (digest recomputed) on a cached store;
    the next ask rebuilds it, saying why."""
    document, _, path = install(reference)
    edit(path / "manifest.json", "positions/mode", lambda v: "bounded", digest=True)
    warnings: list[str] = []
    settings = MethodSettings(warn=warnings.append)
    session = Session(llama, document, "sekv", settings)
    session.ask("Which locker?", max_new_tokens=2)
    assert not session.method.cache_hit
    assert any("positions.mode" in w for w in warnings), warnings


def test_dead_writers_leftovers_are_removed_live_ones_kept(sekv_home):
    stores = sekv_home / "stores"
    dead = subprocess.run(
        [sys.executable, "-c", "print(__import__('os').getpid())"], text=True, capture_output=True
    ).stdout.strip()
    names = {  # leftover: folder, and whether the next build (of "kself") removes it
        "tmp of a dead writer": (".tmp-kdead-x1", True),
        "tmp of a live writer": (".tmp-klive-x1", False),
        "tmp never marked, old": (".tmp-kold-x1", True),
        "trash of a dead process": (f".trash-kgone-{dead}", True),
        "partial with no checkpoint": (".partial-kempty", True),
        "partial whose store was built": (".partial-kbuilt", True),
        "partial with a checkpoint": (".partial-kbook", False),
        "partial being built": (".partial-kbusy", False),
        "partial of this build": (".partial-kself", False),
    }
    folders = {what: stores / name for what, (name, _) in names.items()}
    for folder in folders.values():
        folder.mkdir(parents=True)
    for what, pid in (("tmp of a dead writer", int(dead)), ("tmp of a live writer", os.getpid())):
        mark_writer(folders[what])
        writer = json.loads((folders[what] / ".writer").read_text())
        (folders[what] / ".writer").write_text(json.dumps({**writer, "pid": pid}))
    os.utime(folders["tmp never marked, old"], (0, 0))
    (stores / "kbuilt").mkdir()
    (stores / "kbuilt" / "manifest.json").write_text("{}")
    part = {"name": "part-00000.safetensors", "sha256": "0"}
    record = {"version": STATE_VERSION, "store": "kbook", "parts": [part], "tensors": part}
    (folders["partial with a checkpoint"] / "state.json").write_text(json.dumps(record))
    (folders["partial with a checkpoint"] / part["name"]).write_bytes(b"")
    with store_lock(stores / "kbusy"):  # another process building it
        removed = clean_leftovers(stores, stores / "kself", STATE_VERSION)
    assert sorted(removed) == sorted(folders[w] for w, (_, gone) in names.items() if gone)
    assert {w: not f.exists() for w, f in folders.items()} == {w: g for w, (_, g) in names.items()}


# ---- kill -9 at each stage of an ingest, in real processes --------------------------------

HOOKS = """
import os, signal, sys, time, runpy
def die():
    os.kill(os.getpid(), signal.SIGKILL)
def hook(module, name, before=False, when=lambda *a, **k: True):
    real = getattr(module, name)
    def hooked(*a, **k):
        if before and when(*a, **k):
            die()
        out = real(*a, **k)
        if not before and when(*a, **k):
            die()
        return out
    setattr(module, name, hooked)
"""
CLI = "sys.argv = ['sekv', 'ingest', {doc!r}, '--model', {model!r}, '--json']\n" + (
    "runpy.run_module('sekv_cli', run_name='__main__')\n"
)
STAGES = {  # stage: (hook, what it leaves)
    "prefill": ("import sekv_core.store.build as m; hook(m, 'prefill')", []),
    "first-file": ("import sekv_core.store.write as m; hook(m, 'save_file')", [".tmp-"]),
    "before-rename": (
        "import sekv_core.store.write as m; hook(m, '_replace', before=True)",
        [".tmp-"],
    ),
}


def child_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))


def spawn(script: str) -> subprocess.Popen:
    pipe = subprocess.PIPE
    cmd = [sys.executable, "-c", script]
    return subprocess.Popen(cmd, env=child_env(), text=True, stdout=pipe, stderr=pipe)


def run(script: str) -> subprocess.Popen:
    """``script`` run in a new Python process, to its end; its stderr as ``stderr``."""
    proc = spawn(script)
    _, proc.stderr = proc.communicate(timeout=120)
    return proc


def leftovers(stores: Path) -> list[str]:
    return sorted(p.name[:5] for p in stores.iterdir())


@pytest.mark.parametrize("stage", list(STAGES))
def test_killed_ingest_leaves_nothing_that_loads(
    llama, reference, tiny_model_dirs, sekv_home, stage, tmp_path
):
    document, context, fresh = reference["doc"]
    hook, left = STAGES[stage]
    cli = CLI.format(doc=str(document.path), model=str(tiny_model_dirs["llama"]))
    proc = run(HOOKS + hook + "\n" + cli)
    assert proc.returncode == -9, proc.stderr
    stores = sekv_home / "stores"
    assert leftovers(stores) == left
    assert all(p.stat().st_mode & 0o777 == 0o700 for p in stores.glob(".tmp-*"))
    assert not store_path(llama, document, context, StoreSettings()).exists()
    store, hit = open_or_build(llama, document, context)  # the next ingest
    assert not hit and leftovers(stores) == [store.path.name[:5]]  # the dead writer's: removed
    for name in FILES:
        assert (store.path / name).read_bytes() == (fresh / name).read_bytes(), name


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("small-window") / "llama", "llama", 512)


@pytest.fixture(scope="module")
def small(small_dir):
    return load_model(str(small_dir), device="cpu")


STREAMED = """
import sekv_core.store.stream as stream
from sekv_core.config import StoreSettings, override
from sekv_core.documents import load_document
from sekv_core.models import load_model
from sekv_core.prompt import chat_template, encode_context
from sekv_core.ingest import open_or_build
stream.CHECKPOINT_S = {checkpoint_s}
loaded = load_model({model!r}, device="cpu")
document = load_document({doc!r})
ctx = encode_context(loaded.tokenizer, chat_template(loaded.tokenizer), document.text)
open_or_build(loaded, document, ctx, override(StoreSettings(), {settings!r}))
"""
STREAM_STAGES = {  # stage: (hook, checkpoint_s, what the next ingest warns)
    "after-checkpoint": (
        "import sekv_core.store.checkpoint as m; hook(m.Checkpoints, 'write')",
        0.0,
        "resuming",
    ),
    "mid-part": (
        "import sekv_core.store.partial as m; "
        "hook(m, 'save_file', when=lambda t, p: p.endswith('.tmp'))",
        30.0,
        None,
    ),
}


@pytest.mark.parametrize("stage", list(STREAM_STAGES))
def test_killed_streamed_ingest_resumes_or_restarts(small, small_dir, sekv_home, tmp_path, stage):
    document, context = prepare(small, tmp_path / "book.md", BOOK_TEXT)
    assert len(context) > 512  # a book: streamed, bounded
    hook, checkpoint_s, says = STREAM_STAGES[stage]
    script = STREAMED.format(
        checkpoint_s=checkpoint_s, model=str(small_dir), doc=str(document.path), settings=BOOK_SET
    )
    proc = run(HOOKS + hook + "\n" + script)
    assert proc.returncode == -9, proc.stderr
    stores = sekv_home / "stores"
    (work,) = stores.glob(".partial-*")
    assert work.stat().st_mode & 0o777 == 0o700 and leftovers(stores) == [".part"]
    warnings: list[str] = []
    store, hit = open_or_build(small, document, context, BOOK, warn=warnings.append)
    assert not hit and leftovers(stores) == [store.path.name[:5]]
    assert (says is None and not warnings) or any(says in w for w in warnings), warnings


ASK = (
    "sys.argv = ['sekv', 'ask', {doc!r}, 'What?', '--model', {model!r}, '--json', "
    "'--max-new-tokens', '2']\n"
    "runpy.run_module('sekv_cli', run_name='__main__')\n"
)


@pytest.mark.parametrize("second", ["ingest", "ask"])
def test_concurrent_ingests_build_once(reference, tiny_model_dirs, sekv_home, second):
    """An ingest and a second ingest (or an ask) of one document at once: the second waits for
    the first's lock, then loads its store (the builder holds on in prefill until the other
    process has arrived)."""
    document = reference["doc"][0]
    arrived = sekv_home / "arrived"
    arrived.mkdir(parents=True)
    sync = textwrap.dedent(f"""
        import sekv_core.store.build as b, sekv_core.ingest as ing
        real_lock, real_prefill = ing.store_lock, b.prefill
        def store_lock(*a, **k):
            open({str(arrived)!r} + f"/{{os.getpid()}}", "w").close()
            return real_lock(*a, **k)
        def prefill(*a, **k):
            while len(os.listdir({str(arrived)!r})) < 2:
                time.sleep(0.05)
            time.sleep(0.5)  # the other process now waits on the lock
            return real_prefill(*a, **k)
        ing.store_lock, b.prefill = store_lock, prefill
    """)
    names = dict(doc=str(document.path), model=str(tiny_model_dirs["llama"]))
    other = (CLI if second == "ingest" else ASK).format(**names)
    procs = [spawn(HOOKS + sync + CLI.format(**names)), spawn(HOOKS + sync + other)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    hits = sorted(json.loads(out)["store"]["cache_hit"] for out, _ in outs)
    assert hits == [False, True]
    waiter = next(err for out, err in outs if json.loads(out)["store"]["cache_hit"])
    assert "another sekv process is ingesting" in waiter
    assert leftovers(sekv_home / "stores") == [reference["doc"][2].name[:5]]
