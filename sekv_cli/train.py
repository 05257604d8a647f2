"""`sekv train`: learn the zoom-in router for a model (the base model stays frozen)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from sekv_core.errors import SekvError
from sekv_core.paths import check_home
from sekv_core.threads import resolve_threads

from .errors import handle_errors
from .loading import load_model_quietly
from .options import JSON_OPTION, MODEL_OPTION, THREADS_OPTION
from .output import print_json
from .terminal import err


@handle_errors
def train(
    model: str | None = MODEL_OPTION,
    steps: int = typer.Option(300, "--steps", min=1, help="Optimizer steps (one example each)."),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Router file to write (resumes when it holds an earlier run). "
        "Default: $SEKV_HOME/routers/<model>-<fingerprint>.safetensors, which `sekv ask` "
        "routes with whenever it answers with this model (a file elsewhere: "
        "`sekv bench … --router FILE`).",
    ),
    docs: int = typer.Option(8, "--docs", min=1, help="Generated training documents."),
    doc_tokens: str = typer.Option(
        "500,1500", "--doc-tokens", help="Training document length range in tokens: MIN,MAX."
    ),
    held_out: int = typer.Option(2, "--held-out", min=1, help="Held-out documents (metrics)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the generated corpus and the order."),
    lr: float = typer.Option(5e-3, "--lr", min=0.0, help="Adam learning rate."),
    answer_tokens: int = typer.Option(
        24,
        "--answer-tokens",
        min=0,
        help="Distil along the full-KV model's own answer, up to this many tokens "
        "(0: the planted fact's answer).",
    ),
    json_out: bool = JSON_OPTION,
    threads: int | None = THREADS_OPTION,
) -> None:
    """Train the zoom gate and its threshold on generated documents (CPU is fine)."""
    parts = doc_tokens.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise typer.BadParameter("give MIN,MAX in tokens", param_hint="--doc-tokens")
    low, high = (int(p) for p in parts)
    if not 32 <= low < high:
        raise typer.BadParameter("give MIN,MAX with 32 <= MIN < MAX", param_hint="--doc-tokens")
    from sekv_core.router_files import user_router_path
    from sekv_core.train.loop import train as run  # torch: only once the options are checked
    from sekv_core.train.settings import TrainSettings

    if out is None:  # the router goes under $SEKV_HOME/routers: checked before the slow part
        check_home()
    elif out.exists() and not out.is_file():  # a device, a FIFO, a folder: never replaced
        raise SekvError(
            f"cannot write a router to '{out}': it is not a regular file; pass a file name"
        )
    loaded = load_model_quietly(model, resolve_threads(threads))
    out = out or user_router_path(loaded.model_id, loaded.fingerprint)
    settings = TrainSettings(
        steps=steps,
        docs=docs,
        held_out=held_out,
        seed=seed,
        lr=lr,
        doc_tokens=(low, high),
        answer_tokens=answer_tokens,
    )
    with Progress(
        TextColumn("Training"),
        BarColumn(),
        TextColumn("step {task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as bar:
        task = bar.add_task("train", total=steps)
        metrics = run(
            loaded,
            out,
            settings,
            log=lambda line: err.print(Text(line), soft_wrap=True),  # paths: text, not markup
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    if json_out:
        print_json({"router": str(out), **metrics})
        return
    free = metrics["training_free"]
    recall = ", ".join(
        f"{k.split('@')[1]}: {metrics[k]:.1%} (training-free {free[k]:.1%})"
        for k in metrics
        if k.startswith("target_recall@")
    )
    err.print(
        Text(
            f"Router written to {out}: {metrics['parameters']:,} parameters. Held-out recall of "
            f"the teacher's spans at zoom budget share {recall}"
        )
    )
