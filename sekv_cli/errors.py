"""Errors and warnings as the CLI reports them: ``Error: <one line>`` on stderr and exit 1,
``Warning: <one line>``, a closed pipe's exit 141, Ctrl-C's 130."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.text import Text

from sekv_core.errors import SekvError

from .terminal import OutputClosed, OutputFailed, drop_output, err, guarded_stdout, printable

F = TypeVar("F", bound=Callable[..., Any])


PIPE_CLOSED_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a reader that left early


def fail(message: str) -> None:
    """Print ``Error: message`` on stderr (one line, control characters escaped) and exit 1."""
    typer.echo(f"Error: {printable(message, newlines=False)}", err=True)
    raise typer.Exit(1)


def handle_errors(fn: F) -> F:
    """Turn SekvError (and Ctrl-C) into a one-line error and an exit code. Standard output is
    guarded while the command runs: a full one (``> /dev/full``) is one error line, a closed
    pipe (``| head -1``) ends the command quietly with exit code 141."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with guarded_stdout():
                return fn(*args, **kwargs)
        except SekvError as exc:
            fail(str(exc))
        except OutputClosed:
            drop_output()
            raise typer.Exit(PIPE_CLOSED_EXIT) from None
        except OutputFailed as exc:
            drop_output()
            fail(f"cannot write to standard output: {exc.reason}")
        except KeyboardInterrupt:
            typer.echo("Interrupted.", err=True)
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def warn(message: str) -> None:
    """``Warning: message`` on stderr, the message as plain text, one line however long."""
    err.print(Text("Warning: ", style="yellow") + Text(printable(message, False)), soft_wrap=True)
