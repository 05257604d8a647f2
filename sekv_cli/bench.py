"""`sekv bench …`: benchmarks that print side-by-side figures (never asserted in tests)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .common import (
    JSON_OPTION,
    KV_BITS_OPTION,
    MODEL_OPTION,
    NEAR_OPTION,
    err,
    handle_errors,
    load_model_quietly,
    print_json,
)
from .render import print_rows

bench_app = typer.Typer()  # help: the suite's docstring


def comma_list(value: str, cast: Callable, option: str) -> list:
    try:
        return [cast(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(
            f"expected comma-separated values, got {value!r}", param_hint=option
        ) from None


TRAINED_ROUTER_OPTION = typer.Option(
    "auto",
    "--router",
    help="sekv-trained's router: auto (the one trained for the model) or a file.",
)


SPAN_TOKENS_OPTION = typer.Option(
    None,
    "--span-tokens",
    metavar="MIN,MAX",
    help="SeKV stores: span length bounds in tokens (default 4,8; the span is what a zoom "
    "reconstructs).",
)


NEIGHBOURS_OPTION = typer.Option(
    None,
    "--neighbours",
    min=0,
    metavar="N",
    help="SeKV: a span scores the best of itself and N spans on each side, so a zoom brings "
    "its neighbours (default 1).",
)


def suite_config(methods, tasks, lengths, depths, budgets, seeds, **extra):
    """A SuiteConfig from the comma-separated options (names and ranges checked later)."""
    from sekv_core.bench.suite import SuiteConfig

    return SuiteConfig(
        methods=comma_list(methods, str, "--methods"),
        tasks=comma_list(tasks, str, "--tasks"),
        lengths=comma_list(lengths, int, "--lengths"),
        depths=comma_list(depths, float, "--depths"),
        budgets=comma_list(budgets, float, "--budgets"),
        seeds=comma_list(seeds, int, "--seeds"),
        **extra,
    )


@bench_app.callback(invoke_without_command=True)
@handle_errors
def suite(
    ctx: typer.Context,
    methods: str | None = typer.Option(
        None, help="Methods, comma-separated (default: every registered method)."
    ),
    tasks: str = typer.Option(
        "needle,multikey,multivalue,vartrack,qa", help="Tasks, comma-separated."
    ),
    lengths: str = typer.Option(
        "1000,2000,4000", help="Target lengths in tokens (generated tasks)."
    ),
    depths: str = typer.Option("0.1,0.5,0.9", help="Depths (0..1) of the asked fact."),
    budgets: str = typer.Option(
        "0.1,0.2", help="Resident-memory targets as shares of the fp16 full KV cache."
    ),
    seeds: str = typer.Option("1", help="Seeds of the generated samples, comma-separated."),
    max_new_tokens: int = typer.Option(48, min=1, help="Longest answer, in tokens."),
    recall: bool = typer.Option(
        False, "--recall", help="SeKV methods also report routing recall vs the oracle router."
    ),
    router: str = TRAINED_ROUTER_OPTION,
    span_tokens: str | None = SPAN_TOKENS_OPTION,
    neighbours: int | None = NEIGHBOURS_OPTION,
    near: float | None = NEAR_OPTION,
    kv_bits: int = KV_BITS_OPTION,
    model: str | None = MODEL_OPTION,
    out: Path = typer.Option(Path("sekv-bench"), help="Directory for results and plots."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Benchmarks: figures measured side by side in one run.

    Without a subcommand, the suite: every method at every resident-memory budget on generated
    tasks (needle, multikey, multivalue, vartrack) and on the sample documents' QA. Writes
    results.jsonl, summary.json, results.md and PNG plots into --out; prints the table.
    """
    if ctx.invoked_subcommand is not None:
        return
    from sekv_core.bench.suite import Suite
    from sekv_core.methods import METHODS

    config = suite_config(
        methods or ",".join(METHODS), tasks, lengths, depths, budgets, seeds,
        max_new_tokens=max_new_tokens, recall=recall, trained_router=router,
        kv_bits=kv_bits, span_tokens=span_bounds(span_tokens) if span_tokens else None,
        neighbours=neighbours, near=near,
    )  # fmt: skip
    config.check()  # names and ranges before the model loads; lengths against its window after
    bench = Suite(load_model_quietly(model), config, out)
    sessions = len(bench.samples) * len(bench.configs)
    err.print(f"{len(bench.samples)} samples, {sessions} sessions, {bench.total} answers -> {out}/")
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as bar:
        task = bar.add_task("Answering", total=bench.total)
        summary = bench.run(
            on_row=lambda row: bar.update(
                task, advance=1, description=f"{row['sample']} {row['method']}"
            ),
            on_sample=lambda line: bar.console.print(line, soft_wrap=True, highlight=False),
        )
    if json_out:
        print_json(summary)
        return
    typer.echo((out / "results.md").read_text(), nl=False)


@bench_app.command("fidelity")
@handle_errors
def fidelity(
    methods: str = typer.Option("sekv,sekv-trained", help="Methods, comma-separated (not full)."),
    tasks: str = typer.Option("needle,multikey,qa", help="Tasks, comma-separated."),
    lengths: str = typer.Option("2000,4000", help="Target lengths in tokens (generated tasks)."),
    depths: str = typer.Option("0.25,0.75", help="Depths (0..1) of the asked fact."),
    budgets: str = typer.Option(
        "0.1,0.15,0.2", help="Resident-memory targets as shares of the fp16 full KV cache."
    ),
    seeds: str = typer.Option("1", help="Seeds of the generated samples, comma-separated."),
    answer_tokens: int = typer.Option(24, min=1, help="Reference answer length cap, in tokens."),
    router: str = TRAINED_ROUTER_OPTION,
    every_span: bool = typer.Option(
        False,
        "--every-span",
        help="No memory target: SeKV zooms every span (what its store alone loses).",
    ),
    key_energy: float | None = typer.Option(
        None, min=0.01, max=1.0, help="Store: spectrum share the key bases keep (default 0.999)."
    ),
    value_energy: float | None = typer.Option(
        None, min=0.01, max=1.0, help="Store: spectrum share the value bases keep (default 0.999)."
    ),
    sketch_dim: int | None = typer.Option(
        None, min=1, help="Store: routing sketch dims per span token (default 32)."
    ),
    span_tokens: str | None = SPAN_TOKENS_OPTION,
    neighbours: int | None = NEIGHBOURS_OPTION,
    near: float | None = NEAR_OPTION,
    kv_bits: int = KV_BITS_OPTION,
    model: str | None = MODEL_OPTION,
    out: Path = typer.Option(Path("sekv-fidelity"), help="Directory for the results."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Fidelity to full KV: top-1 agreement and KL along full KV's own answers."""
    from dataclasses import replace

    from sekv_core.bench.fidelity import run_fidelity
    from sekv_core.methods import MethodSettings
    from sekv_core.store import StoreSettings

    if sketch_dim is not None and sketch_dim % 2:
        raise typer.BadParameter(
            f"{sketch_dim} is odd; the 4-bit sketch packs two dims per byte: use an even number",
            param_hint="--sketch-dim",
        )
    chosen = {"key_energy": key_energy, "value_energy": value_energy, "sketch_dim": sketch_dim}
    store = replace(StoreSettings(), **{k: v for k, v in chosen.items() if v is not None})
    if span_tokens is not None:
        store = store.with_span_tokens(*span_bounds(span_tokens))

    config = suite_config(
        methods, tasks, lengths, depths, budgets, seeds,
        max_new_tokens=answer_tokens, trained_router=router,
    )  # fmt: skip
    config.check()
    extra = {"store_settings": store}
    if neighbours is not None:
        extra["neighbours"] = neighbours
    if near is not None:
        extra["near"] = near
    summary = run_fidelity(
        load_model_quietly(model),
        config,
        out,
        answer_tokens,
        MethodSettings(kv_bits=kv_bits, extra=extra),
        every_span=every_span,
        on_row=lambda row: err.print(
            f"{row['sample']} {config_name(row)}: {row['agree']}/{row['tokens']} tokens agree, "
            f"resident {row['resident_ratio']:.1%}",
            highlight=False,
        ),
    )
    if json_out:
        print_json(summary)
        return
    typer.echo((out / "fidelity.md").read_text(), nl=False)


def span_bounds(text: str) -> tuple[int, int]:
    """``MIN,MAX`` span lengths in tokens (usage error if invalid)."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise typer.BadParameter(f"{text!r} is not MIN,MAX (e.g. 4,8)", param_hint="--span-tokens")
    low, high = (int(p) for p in parts)
    if not 1 <= low <= high:
        raise typer.BadParameter(
            f"{text!r}: need 1 <= MIN <= MAX (e.g. 4,8)", param_hint="--span-tokens"
        )
    return low, high


def config_name(row: dict) -> str:
    from sekv_core.bench.suite import config_label

    return config_label(row["method"], row["budget"])


@bench_app.command("report")
@handle_errors
def report(
    runs: list[Path] = typer.Argument(..., help="Directories of `sekv bench` runs to merge."),
    out: Path = typer.Option(..., "--out", help="Directory for the merged report."),
    json_out: bool = JSON_OPTION,
) -> None:
    """One report (summary, Markdown table, plots) from several runs' results."""
    from sekv_core.bench.suite import merge_runs

    summary = merge_runs(runs, out)
    if json_out:
        print_json(summary)
        return
    typer.echo((out / "results.md").read_text(), nl=False)


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
