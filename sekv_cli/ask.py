"""`sekv ask`: answer one question about a document."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from sekv_core.config import MethodSettings
from sekv_core.threads import resolve_threads

from .common import (
    JSON_OPTION,
    METHOD_HELP,
    MODEL_OPTION,
    ROUTER_OPTION,
    THREADS_OPTION,
    handle_errors,
    open_session,
    print_json,
    stream_text,
    warn,
)


@handle_errors
def ask(
    file: Path = typer.Argument(..., help="Document to read: .pdf, .txt or .md."),
    question: str = typer.Argument(..., help="The question to answer."),
    model: str | None = MODEL_OPTION,
    method: str = typer.Option("sekv", "--method", help=METHOD_HELP),
    budget: int | None = typer.Option(
        None,
        "--budget",
        min=1,
        help="Tokens reconstructed per layer and KV head when zooming (sekv; default 256; "
        "a book reads this many tokens of passages, default 512).",
    ),
    router: str = ROUTER_OPTION,
    show_zoom: bool = typer.Option(False, "--show-zoom", help="Print the spans zoomed into."),
    json_out: bool = JSON_OPTION,
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1, help="Answer length cap."),
    threads: int | None = THREADS_OPTION,
) -> None:
    """Answer QUESTION about FILE with a local LLM; the answer streams to stdout."""
    start = time.perf_counter()
    n_threads = resolve_threads(threads)
    settings = MethodSettings(budget=budget, router=router, warn=warn)
    session, load_s = open_session(file, model, method, settings, n_threads, question)
    result = session.ask(question, max_new_tokens, on_text=None if json_out else stream_text)
    result.timings["load_s"] = round(load_s, 4)
    result.timings["threads"] = n_threads
    result.timings["total_s"] = round(time.perf_counter() - start, 4)
    if json_out:
        print_json(result.to_json())
        return
    sys.stdout.write("\n")
    if show_zoom:
        from .render import print_zoom

        print_zoom(result)
