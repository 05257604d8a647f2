"""One needle, asked under several span lengths, neighbour counts and zoom budgets.

    python scripts/needle_by_setting.py --spans 4-8,8-16,24-64 --neighbours 0,1,2 \
        --budgets 128,256,384

The haystack is the integration test's (3.5K tokens, ``NEEDLES[2]`` at depth 0.5, seed 3500);
each line says whether the answer holds the needle, and how it starts. Stores are built once per
span setting under $SEKV_HOME.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sekv_core.bench.haystack import NEEDLES, haystack  # noqa: E402
from sekv_core.documents import load_document  # noqa: E402
from sekv_core.engine import Session  # noqa: E402
from sekv_core.methods import MethodSettings  # noqa: E402
from sekv_core.models import load_model  # noqa: E402
from sekv_core.store import StoreSettings  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--spans", default="4-8,24-64", help="MIN-MAX span lengths, comma-separated"
    )
    parser.add_argument("--neighbours", default="0,1")
    parser.add_argument("--budgets", default="128,256,384")
    parser.add_argument("--tokens", type=int, default=3500)
    args = parser.parse_args()
    loaded = load_model(None)
    needle = NEEDLES[2]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "haystack.txt"
        path.write_text(haystack(loaded.tokenizer, args.tokens, 0.5, needle, seed=args.tokens))
        document = load_document(path)
        for spans in args.spans.split(","):
            low, high = (int(x) for x in spans.split("-"))
            store = StoreSettings().with_span_tokens(low, high)
            for n in (int(x) for x in args.neighbours.split(",")):
                for budget in (int(x) for x in args.budgets.split(",")):
                    extra = {"store_settings": store, "neighbours": n}
                    session = Session(
                        loaded, document, "sekv", MethodSettings(budget=budget, extra=extra)
                    )
                    answer = session.ask(needle.question, 16).answer
                    found = "found" if needle.answer in answer else "lost "
                    print(
                        f"spans {spans:>5}  neighbours {n}  budget {budget:>4}  {found}",
                        repr(answer[:60]),
                    )


if __name__ == "__main__":
    main()
