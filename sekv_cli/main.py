"""The `sekv` command: thin Typer wrappers around sekv_core."""

from __future__ import annotations

import typer

from .ask import ask
from .bench_answers import bench_app  # every bench command registered
from .chat import chat
from .common import HELP_SETTINGS
from .ingest import ingest
from .inspect import inspect
from .train import train

app = typer.Typer(
    help="Ask questions about long documents with a local LLM and a resolution-adaptive KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings=HELP_SETTINGS,
)
app.command()(ask)
app.command()(ingest)
app.command()(inspect)
app.command()(chat)
app.command()(train)
app.add_typer(bench_app, name="bench")


@app.callback()
def main() -> None:
    """sekv: questions about long documents, answered by a local LLM (SeKV cache)."""
