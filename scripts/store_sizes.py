"""The span store on disk against the fp16 full KV cache it replaces, per document.

    python scripts/store_sizes.py                                  # today's codes
    python scripts/store_sizes.py --key-code '*x8' --value-code '*x8'   # another code

Builds a store for each sample document and for generated haystacks of 2K, 4K and 8K tokens
(a needle at half depth, seed 1) under a scratch $SEKV_HOME, and prints one JSON row per
document: tokens, every file of the store's directory together (as ``du -b`` counts them),
the fp16 full KV cache's bytes and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from sekv_bench.haystack import NEEDLES, haystack  # noqa: E402
from sekv_core.config import StoreSettings  # noqa: E402
from sekv_core.documents import load_document  # noqa: E402
from sekv_core.ingest import open_or_build  # noqa: E402
from sekv_core.models import load_model  # noqa: E402
from sekv_core.prompt import chat_template, encode_context  # noqa: E402

SAMPLES = ("handbook.pdf", "lighthouse.md")
LENGTHS = (2000, 4000, 8000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--key-code", default=StoreSettings().key_code)
    parser.add_argument("--value-code", default=StoreSettings().value_code)
    args = parser.parse_args()
    settings = replace(StoreSettings(), key_code=args.key_code, value_code=args.value_code)
    with tempfile.TemporaryDirectory() as scratch:
        os.environ["SEKV_HOME"] = scratch
        loaded = load_model(None)
        docs = [ROOT / "sample_docs" / name for name in SAMPLES]
        for tokens in LENGTHS:
            path = Path(scratch) / f"haystack-{tokens}.txt"
            path.write_text(haystack(loaded.tokenizer, tokens, 0.5, NEEDLES[0], seed=1))
            docs.append(path)
        for path in docs:
            document = load_document(path)
            template = chat_template(loaded.tokenizer)
            context = encode_context(loaded.tokenizer, template, document.text)
            store, _ = open_or_build(loaded, document, context, settings)
            on_disk = sum(f.stat().st_size for f in store.path.rglob("*") if f.is_file())
            full = store.manifest["bytes"]["full_kv_fp16"]
            row = {
                "document": path.name,
                "tokens": len(context),
                "key_code": args.key_code,
                "value_code": args.value_code,
                "store_bytes": on_disk,
                "full_kv_fp16": full,
                "ratio": round(on_disk / full, 4),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
