"""`sekv bench …`: benchmarks that print side-by-side figures (never asserted in tests)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from .common import (
    JSON_OPTION,
    MODEL_OPTION,
    err,
    handle_errors,
    load_model_quietly,
    print_json,
)
from .render import print_rows

bench_app = typer.Typer(
    help="Benchmarks: figures measured side by side in one run.", no_args_is_help=True
)


@bench_app.command("ingest")
@handle_errors
def ingest_bench(
    files: list[Path] = typer.Argument(..., help="Documents to ingest."),
    model: str | None = MODEL_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Span-store build vs plain full-KV prefill: time ratio, resident and stored bytes."""
    from sekv_core.bench.ingest import bench_ingest

    rows = bench_ingest(load_model_quietly(model), files)
    if json_out:
        print_json({"ingest": rows})
        return
    print_rows("ingest vs full-KV prefill (ratios: resident & stored vs fp16 full KV)", rows)


@bench_app.command("needle")
@handle_errors
def needle_bench(
    lengths: str = typer.Option(
        "1000,2000,4000", help="Haystack lengths in tokens, comma-separated."
    ),
    depths: str = typer.Option("0.1,0.3,0.5,0.7,0.9", help="Needle depths (0..1)."),
    budget: int = typer.Option(128, min=1, help="Zoom budget (tokens per layer and KV head)."),
    recall: bool = typer.Option(True, help="Measure routing recall against the oracle router."),
    summaries: bool = typer.Option(False, help="Non-zoomed spans' summaries join the softmax."),
    model: str | None = MODEL_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Needle grid: SeKV vs full KV accuracy, memory, recall, time to first token, decode speed."""
    from sekv_core.bench.needle import bench_needle, summarize_rows

    rows = bench_needle(
        load_model_quietly(model),
        [int(x) for x in lengths.split(",")],
        tuple(float(x) for x in depths.split(",")),
        budget=budget,
        recall=recall,
        summaries=summaries,
        progress=lambda row: err.print(
            f"{row['tokens']} tokens, depth {row['depth']}: full {row['full_ok']}, "
            f"sekv {row['sekv_ok']}, resident {row['resident_ratio']:.1%}, "
            f"recall {row['recall_vs_oracle']}"
        ),
    )
    summary = summarize_rows(rows)
    if json_out:
        print_json({"needle": rows, "summary": summary, "budget": budget, "summaries": summaries})
        return
    print_rows(f"needle grid, budget {budget}", rows)
    Console().print(summary)


@bench_app.command("qa")
@handle_errors
def qa_bench(
    files: list[Path] = typer.Argument(..., help="Documents with a .qa.json beside them."),
    methods: str = typer.Option("full,sekv", help="Methods to compare, comma-separated."),
    budget: int | None = typer.Option(None, min=1, help="Zoom budget (sekv)."),
    summaries: bool = typer.Option(False, help="Non-zoomed spans' summaries join the softmax."),
    model: str | None = MODEL_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Ground-truth questions answered correctly by each method, with resident memory."""
    from sekv_core.bench.qa import bench_qa
    from sekv_core.methods import MethodSettings

    settings = MethodSettings(budget=budget, use_summaries=summaries)
    rows = bench_qa(load_model_quietly(model), files, methods.split(","), settings)
    if json_out:
        print_json({"qa": rows})
        return
    print_rows("ground-truth QA (answer string contained in the answer)", rows)
