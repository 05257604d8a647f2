"""`sekv ingest --cluster` (sekv_core.cluster) on a real local Ray cluster of two CPUs, started
once for the module: the stores a local ingest writes, byte for byte; a worker killed in the
middle of a document, and the document read again; an unreadable file skipped and counted;
without Ray, one error line (tiny random models)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sekv_cli.main import app

runner = CliRunner()
VARYING = ("created", "timings", "digest")  # when and how fast a store was built, and the digest
WORDS = "the keeper of the lighthouse wrote a report on the budget staff and policy in March"


def run(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "1000"})


def kill_once(control: Path):
    """A Ray worker setup hook: in each worker, the build of the document ``control`` names
    (``{"name": ...}``) kills its worker at its first progress inside the document, once
    (the pid it killed is written back to ``control``)."""

    def arm() -> None:
        import sekv_core.cluster as cluster

        build = cluster.open_or_build

        def killed_once(loaded, document, context, settings, progress, warn):
            def report(done: int, total: int) -> None:
                progress(done, total)
                victim = json.loads(control.read_text()) if control.exists() else {}
                if victim.get("name") == document.path.name and "pid" not in victim:
                    if 0 < done < total:  # (written whole: other workers read it meanwhile)
                        tmp = control.with_name(f"{control.name}.{os.getpid()}")
                        tmp.write_text(json.dumps({**victim, "pid": os.getpid()}))
                        os.replace(tmp, control)
                        os.kill(os.getpid(), signal.SIGKILL)

            return build(loaded, document, context, settings, report, warn)

        cluster.open_or_build = killed_once

    return arm


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Path:
    """A local Ray cluster of two CPUs for the module (this process its driver); its
    workers' own $SEKV_HOME, one thread each. Returns the kill hook's control file."""
    ray = pytest.importorskip("ray")
    workers = tmp_path_factory.mktemp("cluster-workers")
    control = workers / "kill.json"
    runtime = {
        "worker_process_setup_hook": kill_once(control),
        "env_vars": {"SEKV_HOME": str(workers / "home"), "OMP_NUM_THREADS": "1"},
    }
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=runtime)
    yield control
    ray.shutdown()


@pytest.fixture
def docs(tmp_path) -> Path:
    """Three documents of 600–900 tokens (two prefill chunks each, within the window) and a
    broken PDF."""
    root = tmp_path / "docs"
    root.mkdir()
    for i, name in enumerate(["alpha.md", "beta.txt", "gamma.md"]):
        lines = [f"Report {i}, part {k}: {WORDS}, {k * 7 + i} boats." for k in range(24 + 4 * i)]
        (root / name).write_text("\n".join(lines))
    (root / "broken.pdf").write_bytes(b"%PDF-1.4 this is no PDF")
    return root


@pytest.fixture
def model(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["llama"])


def ingest_json(*args) -> dict:
    result = run("ingest", *args, "--threads", 1, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def store_files(stores: Path) -> dict[str, bytes]:
    """Every file of every store under ``stores`` (``key/name``), work folders excluded."""
    return {
        f"{d.name}/{f.name}": f.read_bytes()
        for d in sorted(stores.iterdir())
        if d.is_dir() and not d.name.startswith(".")
        for f in sorted(d.iterdir())
    }


def test_cluster_stores_are_a_local_ingests_byte_for_byte(cluster, docs, model, tmp_path):
    local = ingest_json(docs, "--model", model, "--stores", tmp_path / "local")
    shared = tmp_path / "shared"
    data = ingest_json(docs, "--model", model, "--cluster", "local", "--stores", shared)
    assert [Path(d["path"]).name for d in data["documents"]] == ["alpha.md", "beta.txt", "gamma.md"]
    for d in data["documents"]:
        assert d["store"]["cache_hit"] is False and d["attempts"] == 1
        assert d["node"] and d["seconds"] > 0 and d["tokens"] > 600
        assert Path(d["store"]["path"]).parent == shared
    assert [Path(s["path"]).name for s in data["skipped"]] == ["broken.pdf"]  # and counted
    assert data["cluster"]["tokens_read"] > 1800 and data["cluster"]["slots"] == 2
    assert data["in_all"] == local["in_all"] | {"resident_bytes": 0}

    ours, theirs = store_files(tmp_path / "local"), store_files(shared)
    assert ours.keys() == theirs.keys() and len(ours) >= 3 * 4
    for name, content in ours.items():
        if name.endswith("manifest.json"):
            a, b = json.loads(content), json.loads(theirs[name])
            assert {k: v for k, v in a.items() if k not in VARYING} == {
                k: v for k, v in b.items() if k not in VARYING
            }
        else:  # the tensors: the same bytes
            assert content == theirs[name], name

    again = ingest_json(docs, "--model", model, "--cluster", "local", "--stores", shared)
    assert all(d["store"]["cache_hit"] and d["node"] is None for d in again["documents"])
    # a local command on the shared folder verifies and uses what the cluster built
    alone = ingest_json(docs / "gamma.md", "--model", model, "--stores", shared)
    assert alone["store"]["cache_hit"] is True


def test_a_worker_killed_inside_a_document_is_retried(cluster, docs, model, tmp_path):
    cluster.write_text(json.dumps({"name": "beta.txt"}))
    shared = tmp_path / "shared"
    try:
        data = ingest_json(docs, "--model", model, "--cluster", "local", "--stores", shared)
    finally:
        killed = json.loads(cluster.read_text())
        cluster.unlink()
    assert killed.get("pid"), "the worker was not killed"
    rows = {Path(d["path"]).name: d for d in data["documents"]}
    assert rows["beta.txt"]["attempts"] == 2 and rows["alpha.md"]["attempts"] == 1
    assert len(rows) == 3 and len(data["skipped"]) == 1, data["skipped"]  # (why, if one fails)
    assert not [p for p in shared.iterdir() if p.name.startswith(".")]  # nothing half-written
    alone = ingest_json(docs / "beta.txt", "--model", model, "--stores", shared)
    assert alone["store"]["cache_hit"] is True  # verified on load


def test_cluster_without_ray_is_one_error_line(docs, tmp_path):
    shim = tmp_path / "no-ray" / "ray"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    path = os.pathsep.join(filter(None, [str(shim.parent), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, SEKV_HOME=str(tmp_path / "home"))
    result = subprocess.run(
        [sys.executable, "-m", "sekv_cli", "ingest", str(docs), "--cluster", "local"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "Error: --cluster needs Ray, which is not installed; run: pip install 'sekv[cluster]'"
    )
    assert result.stdout == "" and not (tmp_path / "home").exists()
