"""`sekv ask`: answer one question about a document or a collection of them."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer
from rich.text import Text
from typer.core import TyperCommand

from sekv_core.threads import resolve_threads

from .errors import handle_errors
from .loading import open_library
from .options import (
    BUDGET_OPTION,
    JSON_OPTION,
    MAX_NEW_TOKENS_OPTION,
    MAX_TOKENS_OPTION,
    METHOD_OPTION,
    MODEL_OPTION,
    PATHS_ARGUMENT,
    SEED_OPTION,
    TEMPERATURE_OPTION,
    THREADS_OPTION,
    TOP_P_OPTION,
    MethodName,
    answer_settings,
    sampling,
)
from .output import FirstText, check_writable, print_json, stream_text, write_output
from .render import print_sources, print_zoom
from .terminal import err, one_line


class AskCommand(TyperCommand):
    """`sekv ask`, whose usage error for a missing question says so: with one argument the
    parser takes it for the question and reports the documents missing."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        given = bool(args)
        try:
            return super().parse_args(ctx, args)
        except typer.BadParameter as exc:
            if getattr(exc.param, "name", None) != "paths":  # not a missing document
                raise
            what = "a question after the document" if given else "a document and a question"
            ctx.fail(f'give {what}: sekv ask doc.md "What …?"')


@handle_errors
def ask(
    paths: list[Path] = PATHS_ARGUMENT,
    question: str = typer.Argument(..., help="The question to answer."),
    model: str | None = MODEL_OPTION,
    method: MethodName = METHOD_OPTION,
    budget: int | None = BUDGET_OPTION,
    show_zoom: bool = typer.Option(
        False,
        "--show-zoom",
        help="Say per source how much of the answer's attention it held "
        "and why it was zoomed; the zoom and memory used.",
    ),
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="With --show-zoom: the router's scores per zoomed span."
    ),
    html_out: Path | None = typer.Option(
        None,
        "--html",
        metavar="OUT",
        help="Write the answer view to OUT: the document with the sources highlighted and the "
        "zoomed spans shaded by attention (one self-contained HTML file).",
    ),
    json_out: bool = JSON_OPTION,
    max_new_tokens: int = MAX_NEW_TOKENS_OPTION,
    temperature: float = TEMPERATURE_OPTION,
    top_p: float = TOP_P_OPTION,
    seed: int | None = SEED_OPTION,
    threads: int | None = THREADS_OPTION,
    max_tokens: int = MAX_TOKENS_OPTION,
) -> None:
    """Answer QUESTION about the documents at PATH... with a local LLM; the answer streams to
    stdout, then the passages it drew on, with pages (and files, for a collection)."""
    start = time.perf_counter()
    settings = answer_settings(method, budget, temperature, top_p, seed)
    if verbose and not show_zoom:
        raise typer.BadParameter(
            "it adds the router's scores to --show-zoom; pass both", param_hint="-v/--verbose"
        )
    if html_out is not None:
        check_writable(html_out, paths)
    n_threads = resolve_threads(threads)
    library, load_s = open_library(paths, model, method, settings, n_threads, question, max_tokens)
    first = FirstText(None if json_out else stream_text)  # the first token's time
    result = library.ask(
        question,
        max_new_tokens,
        on_text=first,
        sampling=sampling(temperature, top_p, seed),
    )
    result.timings["load_s"] = round(load_s, 4)
    result.timings["threads"] = n_threads
    result.timings["first_token_after_start_s"] = first.after_start  # interpreter start-up too
    result.timings["total_s"] = round(time.perf_counter() - start, 4)
    if not json_out:
        sys.stdout.write("\n")  # the streamed answer's line ends before anything else
        sys.stdout.flush()
    if html_out is not None:
        from .html_answer import render_answer_html  # torch: loaded by now

        session = library.answered
        documents = library.documents() if library.collection else None
        page = render_answer_html(result, session.document, session.context, question, documents)
        write_output(html_out, page)
        err.print(Text(f"wrote {one_line(html_out)}"), soft_wrap=True)
    if json_out:
        print_json(library.to_json(result))
        return
    print_sources(result, with_files=library.collection)
    if show_zoom:
        print_zoom(result, verbose)
