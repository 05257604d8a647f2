"""`sekv bench …`: benchmarks that print side-by-side figures (never asserted in tests)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sekv_bench.report import merge_runs
from sekv_bench.rows import config_label
from sekv_core.config import MethodSettings, override
from sekv_core.errors import SekvError
from sekv_core.method_names import METHOD_NAMES
from sekv_core.threads import resolve_threads

from .errors import handle_errors
from .loading import load_model_quietly
from .options import HELP_SETTINGS, JSON_OPTION, MODEL_OPTION, THREADS_OPTION
from .output import print_json
from .render import print_rows
from .terminal import err, log

if TYPE_CHECKING:
    from sekv_bench.suite import SuiteConfig

# help: the callback's docstring; each benchmark imports its module (and torch) when it runs
bench_app = typer.Typer(context_settings=HELP_SETTINGS)


@bench_app.callback(invoke_without_command=True)
def bench(ctx: typer.Context) -> None:
    """Benchmarks: figures measured side by side in one run.

    Methods: those of `sekv ask` (sekv, full, retrieve) and benchmark peers:
    sekv-training-free and sekv-trained (SeKV with one router only),
    streaming, h2o, snapkv, chunkkv (eviction), static, blocks, truncate.

    Memory is counted as a share of the document's fp16 full KV cache.

    --memory: resident-memory targets in that unit. --budget: zoom tokens per layer and KV head.
    """
    if ctx.invoked_subcommand is None:  # help, not an hours-long run
        typer.echo(ctx.get_help())
        raise typer.Exit(0)


def comma_list(value: str, cast: Callable, option: str) -> list:
    try:
        return [cast(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(
            f"expected comma-separated values, got {value!r}", param_hint=option
        ) from None


def checked_settings(assignments: list[str], budget: int | None = None) -> MethodSettings:
    """MethodSettings with the --set assignments (a usage error names a bad one) and a
    --budget given applied."""
    try:
        settings = override(MethodSettings(), assignments)
    except SekvError as exc:
        raise typer.BadParameter(str(exc), param_hint="--set") from None
    return settings if budget is None else replace(settings, budget=budget)


def method_list(methods: str) -> list[str]:
    """The comma-separated --methods, each a known method (else a usage error)."""
    chosen = comma_list(methods, str, "--methods")
    if any(m not in METHOD_NAMES for m in chosen):
        raise typer.BadParameter(f"choose from {', '.join(METHOD_NAMES)}", param_hint="--methods")
    return chosen


SET_OPTION = typer.Option(
    [],
    "--set",
    metavar="KEY=VALUE",
    help="Set any method setting by its dotted path, repeatable: e.g. --set neighbours=0 "
    "--set store.segment.max_len=16 --set store.key_code=even:0.25.",
)
ROUTER_OPTION = typer.Option(
    "auto",
    "--router",
    help="The trained router of sekv and sekv-trained: auto (yours from `sekv train`, else the "
    "one shipped for the model) or a router file (sekv-training-free uses none).",
)
TRAINED = ("sekv", "sekv-trained")  # the methods that route with a trained router
MEMORY_HELP = "Resident-memory targets as shares of the fp16 full KV cache, comma-separated."
BUDGET_HELP = "Zoom budget: tokens reconstructed per layer and KV head (sekv)."


def with_router(router: str, methods: list[str], sets: list[str]) -> list[str]:
    """The --set assignments with ``router=`` from --router (``auto``: the default, nothing to
    add); a usage error where it names no file, --set names the router too or no method uses
    one."""
    if router == "auto":
        return sets
    if not Path(router).expanduser().is_file():
        raise typer.BadParameter(
            f"no router file at {router}; pass auto or a file written by `sekv train`",
            param_hint="--router",
        )
    if any(a.partition("=")[0].strip() == "router" for a in sets):
        raise typer.BadParameter(
            "give the router once: --router or --set router=", param_hint="--set"
        )
    if not set(methods) & set(TRAINED):
        raise typer.BadParameter(
            f"none of the methods uses a trained router; add {' or '.join(TRAINED)}",
            param_hint="--router",
        )
    return [*sets, f"router={router}"]


def suite_config(
    methods, tasks, lengths, depths, memory, seeds, sets, router="auto", **extra
) -> SuiteConfig:
    """A SuiteConfig from the comma-separated options, checked before the model loads (lengths
    against its window come later)."""
    chosen = comma_list(methods, str, "--methods")
    sets = with_router(router, chosen, sets)
    checked_settings(sets)
    lists = dict(
        methods=chosen,
        tasks=comma_list(tasks, str, "--tasks"),
        lengths=comma_list(lengths, int, "--lengths"),
        depths=comma_list(depths, float, "--depths"),
        memory_shares=comma_list(memory, float, "--memory"),
        seeds=comma_list(seeds, int, "--seeds"),
    )
    from sekv_bench.suite import SuiteConfig

    config = SuiteConfig(**lists, settings=list(sets), **extra)
    config.check()
    return config


def config_name(row: dict) -> str:
    return config_label(row["method"], row["memory_share"])


@bench_app.command("suite")
@handle_errors
def suite(
    methods: str | None = typer.Option(
        None,
        help=f"Methods, comma-separated, of: {', '.join(METHOD_NAMES)} (default: all of them).",
    ),
    tasks: str = typer.Option(
        "needle,multikey,multivalue,vartrack,qa", help="Tasks, comma-separated."
    ),
    lengths: str = typer.Option(
        "1000,2000,4000", help="Target lengths in tokens (generated tasks)."
    ),
    depths: str = typer.Option("0.1,0.5,0.9", help="Depths (0..1) of the asked fact."),
    memory: str = typer.Option("0.1,0.2", "--memory", help=MEMORY_HELP),
    seeds: str = typer.Option("1", help="Seeds of the generated samples, comma-separated."),
    max_new_tokens: int = typer.Option(48, min=1, help="Longest answer, in tokens."),
    recall: bool = typer.Option(
        False, "--recall", help="SeKV methods also report routing recall vs the oracle router."
    ),
    router: str = ROUTER_OPTION,
    sets: list[str] = SET_OPTION,
    model: str | None = MODEL_OPTION,
    threads: int | None = THREADS_OPTION,
    out: Path = typer.Option(Path("sekv-bench"), help="Directory for results and plots."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Every method at every memory share on generated tasks and the sample documents' QA.

    Tasks: needle, multikey, multivalue, vartrack (generated) and qa (the sample documents).
    Writes results.jsonl, summary.json, results.md and PNG plots into --out; prints the table.
    """
    config = suite_config(
        methods or ",".join(METHOD_NAMES), tasks, lengths, depths, memory, seeds, sets,
        router, max_new_tokens=max_new_tokens, recall=recall,
    )  # fmt: skip
    from sekv_bench.suite import Suite

    run = Suite(load_model_quietly(model, resolve_threads(threads)), config, out)
    sessions = len(run.samples) * len(run.configs)
    log.print(f"{len(run.samples)} samples, {sessions} sessions, {run.total} answers -> {out}/")
    with Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as bar:
        task = bar.add_task("Answering", total=run.total)
        summary = run.run(
            on_row=lambda row: bar.update(
                task, advance=1, description=f"{row['sample']} {row['method']}"
            ),
            on_sample=lambda line: bar.console.print(
                line, soft_wrap=True, highlight=False, markup=False
            ),
        )
    if json_out:
        print_json(summary)
        return
    typer.echo((out / "results.md").read_text(), nl=False)


@bench_app.command("fidelity")
@handle_errors
def fidelity(
    methods: str = typer.Option(
        "sekv-training-free,sekv-trained", help="Methods, comma-separated (not full)."
    ),
    tasks: str = typer.Option("needle,multikey,qa", help="Tasks, comma-separated."),
    lengths: str = typer.Option("2000,4000", help="Target lengths in tokens (generated tasks)."),
    depths: str = typer.Option("0.25,0.75", help="Depths (0..1) of the asked fact."),
    memory: str = typer.Option("0.1,0.15,0.2", "--memory", help=MEMORY_HELP),
    seeds: str = typer.Option("1", help="Seeds of the generated samples, comma-separated."),
    answer_tokens: int = typer.Option(24, min=1, help="Reference answer length cap, in tokens."),
    router: str = ROUTER_OPTION,
    every_span: bool = typer.Option(
        False,
        "--every-span",
        help="No memory target: SeKV zooms every span (what its store alone loses).",
    ),
    sets: list[str] = SET_OPTION,
    model: str | None = MODEL_OPTION,
    threads: int | None = THREADS_OPTION,
    out: Path = typer.Option(Path("sekv-fidelity"), help="Directory for the results."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Fidelity to full KV: top-1 agreement and KL along full KV's own answers."""
    config = suite_config(
        methods, tasks, lengths, depths, memory, seeds, sets,
        router, max_new_tokens=answer_tokens,
    )  # fmt: skip
    from sekv_bench.fidelity import run_fidelity

    summary = run_fidelity(
        load_model_quietly(model, resolve_threads(threads)),
        config,
        out,
        answer_tokens,
        every_span=every_span,
        on_row=lambda row: log.print(
            f"{row['sample']} {config_name(row)}: {row['agree']}/{row['tokens']} tokens agree, "
            f"resident {row['resident_share']:.1%}",
        ),
    )
    if json_out:
        print_json(summary)
        return
    typer.echo((out / "fidelity.md").read_text(), nl=False)


@bench_app.command("report")
@handle_errors
def report(
    runs: list[Path] = typer.Argument(..., help="Directories of `sekv bench suite` runs."),
    out: Path = typer.Option(..., "--out", help="Directory for the merged report."),
    json_out: bool = JSON_OPTION,
) -> None:
    """One report (summary, Markdown table, plots) from several runs' results."""
    summary = merge_runs(runs, out)
    if json_out:
        print_json(summary)
        return
    typer.echo((out / "results.md").read_text(), nl=False)


@bench_app.command("ingest")
@handle_errors
def ingest_bench(
    files: list[Path] = typer.Argument(..., help="Documents to ingest."),
    sets: list[str] = SET_OPTION,
    model: str | None = MODEL_OPTION,
    threads: int | None = THREADS_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Span-store build vs plain full-KV prefill: time ratio, resident and stored shares."""
    from sekv_bench.ingest import bench_ingest

    settings = checked_settings(sets)
    rows = bench_ingest(load_model_quietly(model, resolve_threads(threads)), files, settings.store)
    if json_out:
        print_json({"ingest": rows})
        return
    print_rows("ingest vs full-KV prefill (shares: resident & stored vs fp16 full KV)", rows)


@bench_app.command("speed")
@handle_errors
def speed_bench(
    sizes: str = typer.Option("2000,4000,7500", help="Document sizes in tokens, comma-separated."),
    tokens: int = typer.Option(48, min=2, help="Tokens decoded per answer (teacher-forced)."),
    repeats: int = typer.Option(3, min=1, help="Timed answers per method and size."),
    processes: bool = typer.Option(True, help="Also `sekv ingest`/`ask` processes: wall, RSS."),
    contention: bool = typer.Option(False, help="Again beside a CPU-heavy process."),
    model: str | None = MODEL_OPTION,
    threads: int | None = THREADS_OPTION,
    out: Path = typer.Option(Path("docs/bench/speed"), help="Directory for the results."),
    json_out: bool = JSON_OPTION,
) -> None:
    """SeKV vs full KV speed side by side: decode, first token, store build vs prefill.

    Stores are built fresh in a temporary $SEKV_HOME. Writes results.json and results.md.
    """
    n_threads, size_list = resolve_threads(threads), comma_list(sizes, int, "--sizes")
    from sekv_bench.speed import SpeedConfig, bench_speed, progress_line, table_rows

    config = SpeedConfig(size_list, tokens, repeats, processes, contention, model, n_threads)
    loaded = load_model_quietly(model, n_threads)
    result = bench_speed(loaded, config, out, lambda r: log.print(progress_line(r)))
    if json_out:
        print_json(result)
        return
    print_rows(f"SeKV vs full KV speed, {n_threads} threads ({result['machine']['cpu']})",
               table_rows(result))  # fmt: skip
