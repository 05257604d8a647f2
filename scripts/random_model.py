"""Write a random-weight model of the default model's shape, with a long window, for speed runs.

    python scripts/random_model.py /tmp/random-135m [--window 40960] [--layers 30]
    sekv bench speed --model /tmp/random-135m --sizes 16000,32000 --no-processes

The default model reads 8,192 tokens; this one has the same layers, heads and widths
(SmolLM2-135M: 30 layers, 9 query and 3 KV heads of 64, hidden 576) and ``--window`` positions,
so full KV and SeKV can be timed side by side at 16K-32K tokens (e.g. on a GPU, where nothing can
be downloaded). Its answers mean nothing; its cost per token is the default model's. The
tokenizer is a byte-level BPE trained here on the speed benchmark's own filler sentences
(:mod:`sekv_bench.random_model`). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sekv_bench.random_model import write_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the model directory to write")
    parser.add_argument("--window", type=int, default=40_960, help="positions the model reads")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=4096, help="the tokenizer's size")
    parser.add_argument("--narrow", action="store_true", help="narrow heads (a quick CPU check)")
    args = parser.parse_args()
    path = write_model(args.out, args.window, args.layers, args.vocab, args.narrow)
    print(f"{path}: random model, {args.layers} layers, {args.window:,} positions")


if __name__ == "__main__":
    main()
