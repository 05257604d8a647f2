"""Write a generated multi-chapter report with planted facts (a "book") and its ground truth.

    python scripts/make_book.py /tmp/book.md --tokens 150000 [--facts 12] [--seed 0]

Writes ``/tmp/book.md`` and ``/tmp/book.qa.json`` (question, answer, depth per planted fact).
Token counts are the default model's (SmolLM2); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sekv_bench.book import planted_facts, write_book  # noqa: E402
from sekv_core.models import load_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the .md file to write")
    parser.add_argument("--tokens", type=int, default=150_000)
    parser.add_argument("--facts", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = load_model(None).tokenizer
    facts = planted_facts(args.facts, args.seed)
    path = write_book(tokenizer, args.out, args.tokens, facts, args.seed)
    tokens = len(tokenizer(path.read_text(), add_special_tokens=False)["input_ids"])
    print(f"{path}: {tokens:,} tokens, {len(facts)} facts in {path.with_suffix('.qa.json')}")


if __name__ == "__main__":
    main()
