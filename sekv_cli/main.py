"""The `sekv` command: thin Typer wrappers around sekv_core."""

from __future__ import annotations

import typer

from .ask import ask
from .bench_answers import bench_app  # every bench command registered
from .chat import chat
from .common import HELP_SETTINGS
from .help_format import flags_without_types, nothing_cut, sekv_version
from .ingest import ingest
from .inspect import inspect
from .stores import stores_app
from .train import train

flags_without_types()
nothing_cut()
app = typer.Typer(
    help="Ask questions about long documents with a local LLM and a resolution-adaptive KV cache.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for the user's shell
    pretty_exceptions_enable=False,
    context_settings=HELP_SETTINGS,
)
app.command()(ask)
app.command()(ingest)
app.command()(inspect)
app.command()(chat)
app.command()(train)
app.add_typer(bench_app, name="bench")
app.add_typer(stores_app, name="stores")


def print_version(value: bool) -> None:
    if value:
        typer.echo(f"sekv {sekv_version()}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", callback=print_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """sekv: questions about long documents, answered by a local LLM (SeKV cache)."""
