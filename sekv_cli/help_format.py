"""How options read in `--help`: a flag (an option that takes no value) shows no type, and
nothing is cut at 80 columns.

Typer (0.29) prints a type beside every option, ``<bool>`` beside flags such as ``--json`` or
``--help``, which reads as if the flag took a value. :func:`flags_without_types` makes flags show
none; every other option keeps its type (``<int>``, ``OUT``, choices).

Its options table also cuts what does not fit with an ellipsis: an option's name in a narrow
terminal (``--repetition-pena…``), a long word of the help (a path, a default list).
:func:`nothing_cut` keeps names and types whole and folds a long word of the help onto the next
line.

In a group's list of commands (``sekv --help``, ``sekv stores --help``) Typer's rich markup mode
keeps the line breaks of each command's docstring, so a wrapped docstring broke the list's lines
where the source did (a line holding just "a"). :func:`commands_flow` joins them: each command's
text wraps at the terminal's width.
"""

from __future__ import annotations

import inspect
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from rich.table import Table
from rich.text import Text
from typer import rich_utils
from typer.core import TyperOption


def flags_without_types() -> None:
    """Show no type for flags in every command's help (idempotent)."""
    shown = TyperOption.display_type_rich
    if getattr(shown, "sekv_flags", False):
        return

    def display_type_rich(self: TyperOption, ctx) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    display_type_rich.sekv_flags = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


class WholeNamesTable(Table):
    """Typer's options and commands tables: the names (every column but the last two) are never
    wrapped or cut; the type (an options table's last but one) and the help (the last) fold
    a word too long for them."""

    sekv_whole_names = True

    def add_row(self, *renderables: Any, **kwargs: Any) -> None:
        super().add_row(*renderables, **kwargs)
        for column in self.columns[:-2]:
            column.no_wrap = True
        for column in self.columns[-2:]:
            column.overflow = "fold"


def help_text_folds(get_help: Any) -> Any:
    """Typer's ``_get_parameter_help`` with its text items folding long words (a path, a
    default list) instead of cutting them."""

    def folding(*args: Any, **kwargs: Any) -> Any:
        columns = get_help(*args, **kwargs)
        for item in getattr(columns, "renderables", []):
            if isinstance(item, Text):
                item.overflow = "fold"
        return columns

    folding.sekv_folds = True  # type: ignore[attr-defined]
    return folding


def nothing_cut() -> None:
    """Option names and types whole, long help words folded, in every command's help
    (idempotent)."""
    if not getattr(rich_utils.Table, "sekv_whole_names", False):
        rich_utils.Table = WholeNamesTable  # type: ignore[misc]
    if not getattr(rich_utils._get_parameter_help, "sekv_folds", False):
        rich_utils._get_parameter_help = help_text_folds(rich_utils._get_parameter_help)


def command_help_flows(make_help: Any) -> Any:
    """Typer's ``_make_command_help`` (a command's text in its group's list: the first
    paragraph of its docstring) with that paragraph's line breaks read as spaces."""

    def flowing(*args: Any, help_text: str, **kwargs: Any) -> Any:
        first, gap, rest = inspect.cleandoc(help_text).partition("\n\n")
        if not first.startswith("\b"):  # click's mark for a paragraph kept as written
            first = " ".join(first.split("\n"))
        return make_help(*args, help_text=first + gap + rest, **kwargs)

    flowing.sekv_flows = True  # type: ignore[attr-defined]
    return flowing


def commands_flow() -> None:
    """Each command's text in its group's list wraps at the terminal's width (idempotent)."""
    if not getattr(rich_utils._make_command_help, "sekv_flows", False):
        rich_utils._make_command_help = command_help_flows(rich_utils._make_command_help)


def sekv_version() -> str:
    """The installed package's version (``0+unknown`` when run from a bare source tree)."""
    try:
        return version("sekv")
    except PackageNotFoundError:
        return "0+unknown"
