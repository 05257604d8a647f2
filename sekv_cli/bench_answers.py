"""`sekv bench needle|qa|books|sources|folder|index`: how well methods answer, side by side.

The commands register on :data:`sekv_cli.bench.bench_app`; :mod:`sekv_cli.main` takes the app
from here, so that every bench command is on it.
"""

from __future__ import annotations

from pathlib import Path

import typer

from sekv_core.config import DEFAULT_BUDGET, MethodSettings
from sekv_core.threads import resolve_threads

from .bench import (
    BUDGET_HELP,
    SET_OPTION,
    bench_app,
    checked_settings,
    comma_list,
    method_list,
)
from .errors import handle_errors
from .loading import load_model_quietly
from .options import JSON_OPTION, MODEL_OPTION, THREADS_OPTION
from .output import print_json
from .render import print_rows
from .terminal import console, log


@bench_app.command("needle")
@handle_errors
def needle_bench(
    lengths: str = typer.Option(
        "1000,2000,4000", help="Haystack lengths in tokens, comma-separated."
    ),
    depths: str = typer.Option("0.1,0.3,0.5,0.7,0.9", help="Needle depths (0..1)."),
    budget: int = typer.Option(128, "--budget", min=1, help=BUDGET_HELP),
    recall: bool = typer.Option(True, help="Measure routing recall against the oracle router."),
    sets: list[str] = SET_OPTION,
    model: str | None = MODEL_OPTION,
    threads: int | None = THREADS_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Needle grid: SeKV vs full KV accuracy, memory, recall, time to first token, decode speed."""
    from sekv_bench.needle import bench_needle, summarize_rows

    settings = checked_settings(sets)
    rows = bench_needle(
        load_model_quietly(model, resolve_threads(threads)),
        comma_list(lengths, int, "--lengths"),
        tuple(comma_list(depths, float, "--depths")),
        budget=budget,
        recall=recall,
        settings=settings,
        progress=lambda row: log.print(
            f"{row['tokens']} tokens, depth {row['depth']}: full {row['full_ok']}, "
            f"sekv {row['sekv_ok']}, resident {row['resident_share']:.1%}, "
            f"recall {row['recall_vs_oracle']}"
        ),
    )
    summary = summarize_rows(rows)
    if json_out:
        print_json({"needle": rows, "summary": summary, "budget": budget})
        return
    print_rows(f"needle grid, budget {budget}", rows)
    console().print(summary)


@bench_app.command("qa")
@handle_errors
def qa_bench(
    files: list[Path] = typer.Argument(..., help="Documents with a .qa.json beside them."),
    methods: str = typer.Option("full,sekv", help="Methods to compare, comma-separated."),
    budget: int | None = typer.Option(
        None, "--budget", min=1, help=f"{BUDGET_HELP[:-1]}; default {DEFAULT_BUDGET}."
    ),
    sets: list[str] = SET_OPTION,
    model: str | None = MODEL_OPTION,
    threads: int | None = THREADS_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Ground-truth questions answered correctly by each method, with resident memory."""
    from sekv_bench.qa import bench_qa

    settings = checked_settings(sets, budget)
    rows = bench_qa(
        load_model_quietly(model, resolve_threads(threads)),
        files,
        comma_list(methods, str, "--methods"),
        settings,
    )
    if json_out:
        print_json({"qa": rows})
        return
    print_rows("ground-truth QA (answer string contained in the answer)", rows)


@bench_app.command("books")
@handle_errors
def books_bench(
    lengths: str = typer.Option("16000,32000,64000", help="Book lengths in tokens."),
    seeds: str = typer.Option("1", help="Seeds of the generated books, comma-separated."),
    methods: str = typer.Option("sekv,retrieve,truncate", help="Methods, comma-separated."),
    facts: int = typer.Option(6, min=1, help="Facts planted per book (each asked twice)."),
    budget: int | None = typer.Option(
        None,
        "--budget",
        min=1,
        help=f"{BUDGET_HELP[:-1]}; a book reads this many tokens of passages, default "
        f"{MethodSettings().passages}.",
    ),
    max_new_tokens: int = typer.Option(32, min=1, help="Longest answer, in tokens."),
    sets: list[str] = SET_OPTION,
    model: str | None = MODEL_OPTION,
    threads: int | None = THREADS_OPTION,
    out: Path = typer.Option(Path("sekv-books"), help="Directory for books and results."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Books beyond the window: SeKV vs BM25 retrieval vs truncation, exact-word and
    paraphrased questions about facts planted across each book."""
    chosen = method_list(methods)
    settings = checked_settings(sets, budget)
    from sekv_bench.books import bench_books

    rows = bench_books(
        load_model_quietly(model, resolve_threads(threads)),
        comma_list(lengths, int, "--lengths"),
        comma_list(seeds, int, "--seeds"),
        chosen,
        out,
        facts,
        settings,
        max_new_tokens,
        on_row=lambda r: log.print(
            f"{r['tokens']:,} tokens {r['method']} {r['kind']} depth {r['depth']}: "
            f"{'ok' if r['correct'] else 'miss'} ({r['answer'][:50]!r})",
        ),
    )
    if json_out:
        print_json({"books": rows})
        return
    typer.echo((out / "results.md").read_text(), nl=False)


@bench_app.command("folder")
@handle_errors
def folder_bench(
    documents: int = typer.Option(50, "--documents", min=2, help="Reports in the collection."),
    tokens: int = typer.Option(
        300_000, "--tokens", min=100, help="Tokens of the whole collection, shared evenly."
    ),
    facts: int | None = typer.Option(
        None, "--facts", min=1, help="Reports holding a planted fact (default: a quarter)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the generated collection."),
    max_new_tokens: int = typer.Option(32, min=1, help="Longest answer, in tokens."),
    ingest: bool = typer.Option(
        True, help="Build every store before the questions (--no-ingest: as questions need them)."
    ),
    sets: list[str] = SET_OPTION,
    model: str | None = MODEL_OPTION,
    threads: int | None = THREADS_OPTION,
    out: Path = typer.Option(Path("sekv-folder"), help="Directory for the collection and results."),
    json_out: bool = JSON_OPTION,
) -> None:
    """A folder of generated reports, facts planted in some, each asked in its own words,
    paraphrased, and two at a time across the collection: SeKV (documents ranked by words and
    meaning, the best read together) vs retrieve over the whole collection vs full KV given
    the fact's own document; ranking, sources, the first answer on a folder never opened, first
    token, resident memory per document, and a document added (only it read)."""
    settings = checked_settings(sets)
    from sekv_bench.folder import bench_folder

    from .loading import library_progress

    loaded = load_model_quietly(model, resolve_threads(threads))
    with library_progress("Ingesting") as progress:
        result = bench_folder(
            loaded,
            out,
            documents,
            tokens,
            facts,
            settings,
            max_new_tokens,
            seed,
            on_row=lambda r: log.print(
                f"{'+'.join(r['documents'])} {r['kind']}: read {'+'.join(r['read'])}; sekv "
                f"{'ok' if r['sekv_correct'] else 'miss'} ({r['sekv_answer'][:40]!r}), retrieve "
                f"{'ok' if r['retrieve_correct'] else 'miss'}, full "
                f"{'ok' if r['full (own document)_correct'] else 'miss'}"
            ),
            progress=progress,
            ingest=ingest,
        )
    if json_out:
        print_json(result)
        return
    typer.echo((out / "results.md").read_text(), nl=False)


@bench_app.command("index")
@handle_errors
def index_bench(
    documents: int = typer.Option(1000, "--documents", min=2, help="Generated reports."),
    tokens: int = typer.Option(1_000_000, "--tokens", min=100, help="Tokens of all of them."),
    sizes: str = typer.Option("100,300,1000", help="Folder sizes indexed, comma-separated."),
    model: str | None = MODEL_OPTION,
    threads: int | None = THREADS_OPTION,
    out: Path = typer.Option(Path("sekv-index"), help="Directory for the reports and indexes."),
    json_out: bool = JSON_OPTION,
) -> None:
    """The collection index alone as a folder grows: build speed, bytes per 1K tokens, opening
    an indexed folder, ranking a question, the planted facts' documents ranked first, peak
    RSS (the model's tokenizer counts tokens; no answer is generated)."""
    from sekv_bench.index_scale import bench_index

    loaded = load_model_quietly(model, resolve_threads(threads))
    rows = bench_index(
        loaded.tokenizer, out, documents, tokens, comma_list(sizes, int, "--sizes"),
        on_size=lambda r: log.print(
            f"{r['documents']} documents: built in {r['build_s']} s, opened in {r['open_s']} s, "
            f"ranked in {r['rank_s_median']} s"
        ),
    )  # fmt: skip
    if json_out:
        print_json(rows)
        return
    typer.echo((out / "results.md").read_text(), nl=False)


@bench_app.command("sources")
@handle_errors
def sources_bench(
    methods: str = typer.Option("sekv,full", help="Methods to compare, comma-separated."),
    lengths: str = typer.Option("2000,4000,7500", help="Haystack lengths in tokens."),
    depths: str = typer.Option("0.2,0.5,0.8", help="Depths of the planted facts (0..1)."),
    seeds: str = typer.Option("1", help="Seeds of the generated haystacks, comma-separated."),
    max_new_tokens: int = typer.Option(48, min=1, help="Longest answer, in tokens."),
    sets: list[str] = SET_OPTION,
    model: str | None = MODEL_OPTION,
    threads: int | None = THREADS_OPTION,
    out: Path = typer.Option(Path("docs/bench/sources"), help="Directory for the results."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Answer sources: does the first hold the answer, on its page? SeKV beside full KV.

    Sample QA and PDF haystacks; decode speed with sources recorded and without.
    """
    chosen = method_list(methods)
    settings = checked_settings(sets)
    n_threads = resolve_threads(threads)
    from sekv_bench.sources import (
        bench_sources,
        haystack_items,
        qa_items,
        summary,
        write_results,
    )

    loaded = load_model_quietly(model, n_threads)
    items = qa_items(loaded.tokenizer) + haystack_items(
        loaded.tokenizer,
        comma_list(lengths, int, "--lengths"),
        comma_list(depths, float, "--depths"),
        comma_list(seeds, int, "--seeds"),
        out / "haystacks",
    )
    rows = bench_sources(
        loaded,
        items,
        chosen,
        settings,
        max_new_tokens,
        on_row=lambda r: log.print(
            f"{r['document']} {r['method']}: {'ok' if r['correct'] else 'miss'}, first source "
            f"{'holds it' if r['first_has_answer'] else 'does not'} (p. {r['first_page']} of "
            f"{r['page']})",
        ),
    )
    table = summary(rows, chosen)
    meta = {"model": loaded.model_id, "threads": n_threads, "max_new_tokens": max_new_tokens}
    write_results(out, rows, table, meta)
    if json_out:
        print_json({"summary": table, "rows": rows})
        return
    print_rows(f"answer sources, {loaded.model_id}, {n_threads} threads", table)
