"""The options commands share (model, threads, JSON, method, budget, document size, answer
length) and the usage check between two of them."""

from __future__ import annotations

from typing import Literal

import typer

from sekv_core.config import DEFAULT_BUDGET, MAX_TOKENS, MethodSettings
from sekv_core.method_names import USER_METHODS
from sekv_core.threads import THREADS_ENV, default_threads

HELP_SETTINGS = {"help_option_names": ["--help", "-h"]}  # Typer context_settings: -h too

MODEL_OPTION = typer.Option(
    None,
    "--model",
    "-m",
    help="Hugging Face id, local directory or .gguf file (default: embedded SmolLM2).",
)
JSON_OPTION = typer.Option(False, "--json", help="Print one JSON object on stdout.")
THREADS_OPTION = typer.Option(
    None,
    "--threads",
    min=1,
    help=f"CPU threads torch uses (default: ${THREADS_ENV}, else $OMP_NUM_THREADS, "
    f"else {default_threads()} here).",
)
MethodName = Literal[USER_METHODS]  # a Choice: any other name is a usage error naming these
METHOD_OPTION = typer.Option(
    "sekv",
    "--method",
    help="How the document is held: sekv (the span store, zooming in), full (the whole KV "
    "cache) or retrieve (BM25 passages filling the window). Baselines: `sekv bench`.",
)
BUDGET_OPTION = typer.Option(
    None,
    "--budget",
    min=1,
    help=f"Tokens reconstructed per layer and KV head when zooming (sekv only; default "
    f"{DEFAULT_BUDGET}; a book reads this many tokens of passages, default "
    f"{MethodSettings().passages}).",
)
MAX_TOKENS_OPTION = typer.Option(
    MAX_TOKENS,
    "--max-tokens",
    min=1,
    help="Refuse a document of more tokens than this unless its store is built already (a "
    "streamed ingest reads ~100-200 tokens/s on a CPU); a file too big for that many tokens is "
    "refused before it is read.",
)

MAX_NEW_TOKENS_OPTION = typer.Option(128, "--max-new-tokens", min=1, help="Answer length cap.")


def check_budget(method: str, budget: int | None) -> None:
    """A usage error for ``--budget`` with a method that does not zoom."""
    if budget is not None and method != "sekv":
        raise typer.BadParameter(
            f"it applies to --method sekv only; {method} does not zoom", param_hint="--budget"
        )
