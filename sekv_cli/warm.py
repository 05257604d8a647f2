"""`sekv warm`: keep a process with torch, transformers and sekv imported, so that later
commands start in about a second (:mod:`.warm_process`)."""

from __future__ import annotations

import time

import typer

from .errors import handle_errors
from .options import JSON_OPTION
from .output import print_json
from .terminal import console
from .warm_process import IDLE_S, start, status, stop
from .words import how_many


@handle_errors
def warm(
    idle: float = typer.Option(
        IDLE_S / 60, "--idle", min=0.1, help="Minutes without a command before it ends."
    ),
    stop_it: bool = typer.Option(False, "--stop", help="End the warm process now."),
    show: bool = typer.Option(False, "--status", help="Say whether one runs; start none."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Keep sekv warm: a background process with the libraries imported runs each later `sekv`
    command for this $SEKV_HOME, so it answers seconds sooner (set SEKV_WARM=0 to bypass it)."""
    if stop_it:
        data: dict = {"stopped": stop()}
        message = "The warm process ends." if data["stopped"] else "No warm process runs."
    elif show:
        data = {"warm": status()}
        message = describe(data["warm"]) if data["warm"] else "No warm process runs."
    else:
        data = {"warm": start(idle * 60)}
        message = describe(data["warm"])
    if json_out:
        print_json(data)
    else:
        console().print(message, highlight=False)


def describe(state: dict) -> str:
    since = time.strftime("%H:%M", time.localtime(state["started"]))
    commands = how_many(state["served"], "command")
    minutes = f"{state['idle_limit_s'] / 60:g}"
    return (
        f"sekv is warm (since {since}, {commands} run): later commands for this $SEKV_HOME "
        f"start in about a second, until {minutes} minutes pass without one; "
        "`sekv warm --stop` ends it."
    )
