"""Book benchmark with the default model: streamed ingest and needles at length.

    python scripts/bench_book.py ingest --tokens 150000          # peak RSS, tokens/s 10/50/100%
    python scripts/bench_book.py ingest --tokens 33000 --set store.segment.max_len=16  # settings
    python scripts/bench_book.py needles --lengths 16000,32000,64000,128000
    python scripts/bench_book.py needles --lengths 6000 --depths 0.1,0.5,0.9   # full KV fits

``ingest`` generates a book (scripts/make_book.py's report), streams it into a fresh span store
under $SEKV_HOME (set it to a scratch directory) and prints one JSON object; run it in its own
process so that the peak RSS is the ingest's. ``needles`` builds one book per length with a
needle at each depth, asks the three questions, and prints one JSON row per question (full KV
answers where the context fits the model window).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sekv_bench.book import (  # noqa: E402
    DEPTHS,
    LENGTHS,
    bench_book_ingest,
    bench_book_needles,
    planted_facts,
    write_book,
)
from sekv_core.config import DEFAULT_BUDGET, MethodSettings, override  # noqa: E402
from sekv_core.errors import SekvError  # noqa: E402
from sekv_core.models import load_model  # noqa: E402


def numbers(text: str, kind=int) -> tuple:
    return tuple(kind(x) for x in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ingest = sub.add_parser("ingest")
    ingest.add_argument("--tokens", type=int, default=150_000)
    ingest.add_argument("--book", type=Path, help="an existing book instead of a generated one")
    ingest.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a method setting by its dotted path (store.*: the store's), repeatable",
    )
    needles = sub.add_parser("needles")
    needles.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    needles.add_argument("--depths", default=",".join(map(str, DEPTHS)))
    needles.add_argument("--budget", type=int, default=DEFAULT_BUDGET, help="zoom tokens")
    args = parser.parse_args()
    try:  # before the model loads
        settings = override(MethodSettings(), getattr(args, "sets", []))
    except SekvError as exc:
        parser.error(str(exc))
    loaded = load_model(None)
    if args.command == "ingest":
        with tempfile.TemporaryDirectory() as tmp:
            path = args.book or write_book(
                loaded.tokenizer, Path(tmp) / "book.md", args.tokens, planted_facts(12)
            )
            row = bench_book_ingest(loaded, path, settings.store)
            print(json.dumps(row, indent=1), flush=True)
    else:
        rows = bench_book_needles(
            loaded,
            numbers(args.lengths),
            numbers(args.depths, float),
            args.budget,
            progress=lambda row: print(json.dumps(row), flush=True),
        )
        sekv = sum(r["sekv_ok"] for r in rows)
        full = [r["full_ok"] for r in rows if r["full_ok"] is not None]
        full_score = f"{sum(full)}/{len(full)}" if full else "n/a (beyond the window)"
        summary = {"sekv": f"{sekv}/{len(rows)}", "full": full_score}
        print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
