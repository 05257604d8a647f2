"""How options read in `--help`: a flag (an option that takes no value) shows no type.

Typer (0.29) prints a type beside every option, ``<bool>`` beside flags such as ``--json`` or
``--help``, which reads as if the flag took a value. :func:`flags_without_types` makes flags show
none; every other option keeps its type (``<int>``, ``OUT``, choices).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

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


def sekv_version() -> str:
    """The installed package's version (``0+unknown`` when run from a bare source tree)."""
    try:
        return version("sekv")
    except PackageNotFoundError:
        return "0+unknown"
