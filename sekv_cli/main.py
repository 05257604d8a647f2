"""The `sekv` command: thin Typer wrappers around sekv_core."""

from __future__ import annotations

import sys
from typing import Any

import typer

from .ask import AskCommand, ask
from .bench_answers import bench_app  # every bench command registered
from .chat import chat
from .errors import PIPE_CLOSED_EXIT
from .help_format import commands_flow, flags_without_types, nothing_cut, sekv_version
from .ingest import ingest
from .inspect import inspect
from .options import HELP_SETTINGS
from .stores import stores_app
from .terminal import OutputClosed, OutputFailed, drop_output, guarded_stdout
from .train import train
from .warm import warm


class Sekv(typer.Typer):
    """The app, with standard output guarded around all it does: what is printed before a
    command runs (``--help``, ``--version``) fails as a command's output does, one error line
    for a full one, quietly (exit 141) for a closed pipe."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            with guarded_stdout():
                return super().__call__(*args, **kwargs)
        except OutputClosed:
            drop_output()
            sys.exit(PIPE_CLOSED_EXIT)
        except OutputFailed as exc:
            drop_output()
            print(f"Error: cannot write to standard output: {exc.reason}", file=sys.stderr)
            sys.exit(1)


flags_without_types()
nothing_cut()
commands_flow()
app = Sekv(
    help="Ask questions about long documents with a local LLM and a resolution-adaptive KV cache.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for the user's shell
    pretty_exceptions_enable=False,
    context_settings=HELP_SETTINGS,
)
app.command(cls=AskCommand)(ask)
app.command()(ingest)
app.command()(inspect)
app.command()(chat)
app.command()(train)
app.command()(warm)
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
