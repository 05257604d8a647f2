"""The arguments and options commands share (documents, model, threads, JSON, method, budget,
document size; an answer's length, greedy by default, sampling on request) and the usage checks
between them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import typer

from sekv_core.config import DEFAULT_BUDGET, MAX_TOKENS, MethodSettings
from sekv_core.method_names import USER_METHODS
from sekv_core.threads import THREADS_ENV, default_threads

from .errors import warn

HELP_SETTINGS = {"help_option_names": ["--help", "-h"]}  # Typer context_settings: -h too


def document_path(value: str) -> Path | str:
    """A PATH argument as a Path; an empty one kept as "" (a Path would make it ".", the
    current folder) for :func:`sekv_cli.loading.open_library` to refuse."""
    return Path(value) if value else value


PATHS_ARGUMENT = typer.Argument(
    ...,
    help="A document (.pdf, .txt or .md), several, or a folder (read recursively).",
    metavar="PATH...",
    show_default=False,
    parser=document_path,
)


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


def finite(value: float) -> float:
    """A typer callback: refuse inf and nan (a usage error saying so)."""
    if not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number; pass a finite value")
    return value


def temperature_value(value: float) -> float:
    if finite(value) < 0:
        raise typer.BadParameter(f"{value} is negative; pass 0 (greedy) or more")
    return value


def top_p_value(value: float) -> float:
    if not 0 < finite(value) <= 1:
        raise typer.BadParameter(f"{value} is not in (0, 1]; pass e.g. 0.9")
    return value


TEMPERATURE_OPTION = typer.Option(
    0.0,
    "--temperature",
    callback=temperature_value,
    help="0: greedy, the same answer every time; above 0: sample (higher: more varied).",
)
TOP_P_OPTION = typer.Option(
    1.0,
    "--top-p",
    callback=top_p_value,
    help="With --temperature: sample among the likeliest tokens holding this probability.",
)
SEED_OPTION = typer.Option(
    None,
    "--seed",
    help="With --temperature: the sampling seed (same seed, same answer; default: none, a "
    "fresh draw each time).",
)


def check_sampling(temperature: float, top_p: float, seed: int | None) -> None:
    """A usage error for sampling options given without sampling (``temperature`` 0)."""
    if temperature > 0:
        return
    for given, option in ((seed is not None, "--seed"), (top_p != 1, "--top-p")):
        if given:
            raise typer.BadParameter(
                "it applies to sampling only; add --temperature above 0 (0 is greedy)",
                param_hint=option,
            )


def answer_settings(
    method: str, budget: int | None, temperature: float, top_p: float, seed: int | None
) -> MethodSettings:
    """The usage checks of ``ask``'s and ``chat``'s options (:func:`check_budget`,
    :func:`check_sampling`), then the method's settings they give (warnings on stderr)."""
    check_budget(method, budget)
    check_sampling(temperature, top_p, seed)
    return MethodSettings(budget=budget, warn=warn)


def sampling(temperature: float, top_p: float, seed: int | None):
    """The :class:`sekv_core.sampling.Sampling` of these options (None: greedy)."""
    if temperature == 0:
        return None
    from sekv_core.sampling import Sampling  # torch: the session is open by now

    return Sampling(temperature, top_p, seed)
