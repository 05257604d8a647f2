"""The cluster ingest's speed on this machine, side by side: one worker against two over the same
folder of generated documents, and the cluster path's overhead on one document.

Usage: OMP_NUM_THREADS=1 python scripts/cluster_speed.py [--documents 20] [--rounds 2] [OUT]

Each configuration is a local Ray cluster of 1 or 2 CPUs started in this process (one task at a
time per CPU, one torch thread each), stopped after its run; each run builds every store anew
into a fresh folder. Runs alternate (1, 2, 1, 2, …) so that load from other work on the machine
falls on both. Prints tokens/s of each run and the ratio of their medians; then one document
read by a plain local ingest (model loaded), by a cluster's cold worker (its model loaded
first) and by a warm one, and the seconds a local cluster takes to start. Needs the default
model and Ray (pip install 'sekv[cluster]').
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import ray

from sekv_core.cluster import ingest_on_cluster
from sekv_core.collection import select_documents
from sekv_core.config import StoreSettings
from sekv_core.documents import load_document
from sekv_core.ingest import open_or_build
from sekv_core.models import load_model
from sekv_core.paths import STORES_ENV
from sekv_core.prompt import encode_context
from sekv_core.threads import apply_threads

TOPICS = ["harbour", "library", "orchard", "observatory", "bakery", "railway", "museum", "clinic"]
NAMES = ["Orla", "Tomasz", "Ines", "Kofi", "Mei", "Arvid", "Lucia", "Yusuf", "Hana", "Piet"]
VERBS = ["inspected", "repaired", "counted", "catalogued", "opened", "moved", "audited"]
THINGS = ["boats", "lamps", "ledgers", "crates", "benches", "clocks", "maps", "pumps"]


def write_documents(folder: Path, n: int, seed: int = 0) -> None:
    """``n`` reports of 15–70 sentences (about 300–1,500 tokens) in ``folder``."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        topic = rng.choice(TOPICS)
        lines = [f"# Report {i}: the {topic}", ""]
        for k in range(rng.randint(15, 70)):
            who, verb, what = rng.choice(NAMES), rng.choice(VERBS), rng.choice(THINGS)
            lines.append(
                f"On day {k + 1} {who} {verb} {rng.randint(2, 90)} {what} at the {topic}, "
                f"and noted that the {rng.choice(THINGS)} needed attention by {rng.choice(NAMES)}."
            )
        (folder / f"report-{i:02d}.md").write_text("\n".join(lines) + "\n")


def cluster_run(folder: Path, loaded, workers: int, root: Path) -> tuple[float, int, float]:
    """One ingest of ``folder`` on a fresh local cluster of ``workers`` CPUs into a fresh store
    folder: (tokens/s, tokens read, seconds the cluster took to start)."""
    os.environ[STORES_ENV] = tempfile.mkdtemp(dir=root, prefix=f"stores-{workers}-")
    start = time.perf_counter()
    ray.init(
        num_cpus=workers,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    started = time.perf_counter() - start
    try:
        result = ingest_on_cluster("local", loaded, None, select_documents([folder]), threads=1)
    finally:
        ray.shutdown()
    return result.tokens_per_s, result.tokens_read, started


def one_document(document: Path, loaded, root: Path) -> dict[str, float]:
    """Seconds to read ``document`` locally (model loaded) and on a started cluster of one CPU,
    its worker cold (loading the model) and warm."""
    out = {}
    os.environ[STORES_ENV] = tempfile.mkdtemp(dir=root, prefix="stores-local-")
    doc = load_document(document)
    context = encode_context(loaded.tokenizer, loaded.template, doc.text)
    start = time.perf_counter()
    open_or_build(loaded, doc, context, StoreSettings())
    out["local_s"] = time.perf_counter() - start
    start = time.perf_counter()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    out["cluster_start_s"] = time.perf_counter() - start
    try:
        for kind in ("cold", "warm"):
            os.environ[STORES_ENV] = tempfile.mkdtemp(dir=root, prefix=f"stores-{kind}-")
            start = time.perf_counter()
            ingest_on_cluster("local", loaded, None, select_documents([document]), threads=1)
            out[f"cluster_{kind}_s"] = time.perf_counter() - start
    finally:
        ray.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("out", nargs="?", type=Path, help="folder for documents and stores")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="sekv-cluster-speed-"))
    folder = root / "documents"
    write_documents(folder, args.documents)
    apply_threads(1)
    loaded = load_model(None)
    runs: dict[int, list[float]] = {1: [], 2: []}
    for r in range(args.rounds):
        for workers in (1, 2):
            speed, tokens, started = cluster_run(folder, loaded, workers, root)
            runs[workers].append(speed)
            print(
                f"round {r + 1}, {workers} worker(s): {tokens:,} tokens, {speed:,.1f} tokens/s "
                f"(cluster started in {started:.1f} s)",
                flush=True,
            )
    one, two = statistics.median(runs[1]), statistics.median(runs[2])
    print(f"median tokens/s: 1 worker {one:,.1f}, 2 workers {two:,.1f}; ratio {two / one:.2f}")
    single = one_document(folder / "report-00.md", loaded, root)
    print(
        "one document ({:,} tokens): local {local_s:.2f} s; cluster, cold worker "
        "{cluster_cold_s:.2f} s, warm worker {cluster_warm_s:.2f} s; a local cluster starts in "
        "{cluster_start_s:.1f} s".format(
            len(
                encode_context(
                    loaded.tokenizer,
                    loaded.template,
                    load_document(folder / "report-00.md").text,
                )
            ),
            **single,
        )  # fmt: skip
    )


if __name__ == "__main__":
    main()
