"""`sekv ask`: answer one question about a document."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.methods import METHODS, MethodSettings

from .common import handle_errors, load_model_quietly, prefill_progress, print_json, warn


@handle_errors
def ask(
    file: Path = typer.Argument(..., help="Document to read: .pdf, .txt or .md."),
    question: str = typer.Argument(..., help="The question to answer."),
    model: str | None = typer.Option(
        None,
        "--model",
        "-m",
        help="Hugging Face id or local directory (default: embedded SmolLM2).",
    ),
    method: str = typer.Option("sekv", "--method", help=f"One of: {', '.join(METHODS)}."),
    budget: int | None = typer.Option(
        None,
        "--budget",
        min=1,
        help="Tokens reconstructed per layer and KV head when zooming (sekv; default 256).",
    ),
    summaries: bool = typer.Option(
        False, "--summaries", help="Let non-zoomed spans join attention as summaries (sekv)."
    ),
    show_zoom: bool = typer.Option(False, "--show-zoom", help="Print the spans zoomed into."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1, help="Answer length cap."),
) -> None:
    """Answer QUESTION about FILE with a local LLM; the answer streams to stdout."""
    if method not in METHODS:
        raise typer.BadParameter(f"choose one of: {', '.join(METHODS)}", param_hint="--method")
    start = time.perf_counter()
    document = load_document(file)
    loaded = load_model_quietly(model)
    load_s = time.perf_counter() - start
    with prefill_progress(f"Reading {file.name}") as progress:
        settings = MethodSettings(budget=budget, use_summaries=summaries, warn=warn)
        session = Session(loaded, document, method, settings, progress)

    def stream(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    result = session.ask(question, max_new_tokens, on_text=None if json_out else stream)
    result.timings["load_s"] = round(load_s, 4)
    result.timings["total_s"] = round(time.perf_counter() - start, 4)
    if json_out:
        print_json(result.to_json())
        return
    sys.stdout.write("\n")
    if show_zoom:
        from .render import print_zoom

        print_zoom(result)
