"""The span store on disk against the fp16 full KV cache it replaces, per document, in one run.

    python scripts/store_sizes.py                         # samples, 2K/4K/8K haystacks
    python scripts/store_sizes.py --books 16000,32000,64000   # and generated books (slow)
    python scripts/store_sizes.py --lengths 20,60,200,500,1000,2000,4000 --loads 0

Builds a store for each sample document, for generated haystacks of ``--lengths`` tokens
(default 2K, 4K and 8K; a needle at half depth, seed 1) and for generated books of the given
token counts (seed 1) under a scratch $SEKV_HOME, and prints one JSON row per document:
tokens, the store's files together (as ``du -b`` counts them), the fp16 full KV cache's bytes
and their ratio, the build's seconds and the median seconds of ``--loads`` loads of the stored
document (its three load stages: verify, read, sketch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from sekv_bench.book import planted_facts, write_book  # noqa: E402
from sekv_bench.haystack import NEEDLES, haystack  # noqa: E402
from sekv_core.config import StoreSettings  # noqa: E402
from sekv_core.documents import load_document  # noqa: E402
from sekv_core.ingest import open_or_build  # noqa: E402
from sekv_core.models import load_model  # noqa: E402
from sekv_core.paths import home_path  # noqa: E402
from sekv_core.prompt import encode_context  # noqa: E402
from sekv_core.store.format import StoreSource  # noqa: E402
from sekv_core.store.load import load_store  # noqa: E402

SAMPLES = ("handbook.pdf", "lighthouse.md")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--key-code", default=StoreSettings().key_code)
    parser.add_argument("--value-code", default=StoreSettings().value_code)
    parser.add_argument("--books", default="", help="book lengths in tokens, comma-separated")
    parser.add_argument(
        "--lengths", default="2000,4000,8000", help="haystack lengths in tokens, comma-separated"
    )
    parser.add_argument("--loads", type=int, default=3, help="timed loads per document")
    args = parser.parse_args()
    settings = replace(StoreSettings(), key_code=args.key_code, value_code=args.value_code)
    models = home_path() / "models"  # converted models: reused, not converted again
    with tempfile.TemporaryDirectory() as scratch:
        os.environ["SEKV_HOME"] = scratch
        if models.is_dir():
            (Path(scratch) / "models").symlink_to(models)
        loaded = load_model(None)
        docs = [ROOT / "sample_docs" / name for name in SAMPLES]
        for tokens in (int(t) for t in args.lengths.split(",") if t.strip()):
            path = Path(scratch) / f"haystack-{tokens}.txt"
            path.write_text(haystack(loaded.tokenizer, tokens, 0.5, NEEDLES[0], seed=1))
            docs.append(path)
        for tokens in (int(t) for t in args.books.split(",") if t.strip()):
            path = Path(scratch) / f"book-{tokens}.md"
            docs.append(write_book(loaded.tokenizer, path, tokens, planted_facts(12, 1), 1))
        for path in docs:
            document = load_document(path)
            context = encode_context(loaded.tokenizer, loaded.template, document.text)
            t0 = time.perf_counter()
            store, _ = open_or_build(loaded, document, context, settings)
            build_s = time.perf_counter() - t0
            loads = []
            for _ in range(args.loads):
                t0 = time.perf_counter()
                load_store(store.path, StoreSource(loaded, document, context, settings))
                loads.append(time.perf_counter() - t0)
            on_disk = sum(f.stat().st_size for f in store.path.rglob("*") if f.is_file())
            full = store.manifest["bytes"]["full_kv_fp16"]
            row = {
                "document": path.name,
                "tokens": len(context),
                "positions": store.manifest["positions"]["mode"],
                "key_code": args.key_code,
                "value_code": args.value_code,
                "store_bytes": on_disk,
                "full_kv_fp16": full,
                "ratio": round(on_disk / full, 4),
                "build_s": round(build_s, 2),
                "load_s": round(statistics.median(loads), 3) if loads else None,
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
