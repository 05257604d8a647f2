"""`sekv stores`: list, remove and prune the span stores under $SEKV_HOME/stores."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from sekv_core.store import shelf
from sekv_core.store.shelf import Removal, StoreEntry

from .errors import fail, handle_errors, warn
from .options import HELP_SETTINGS, JSON_OPTION
from .output import print_json
from .terminal import console, one_line
from .words import how_many, human_bytes

stores_app = typer.Typer(
    help="List, remove and prune the stores documents were read into ($SEKV_HOME/stores).",
    no_args_is_help=True,
    context_settings=HELP_SETTINGS,
)


@stores_app.command("list")
@handle_errors
def list_(json_out: bool = JSON_OPTION) -> None:
    """List every store: document, model, tokens, size on disk, last use, key (`sekv stores rm
    KEY` takes it; full paths: --json); also an interrupted ingest a rerun resumes, and what a
    killed process left (`sekv stores prune` removes the latter). One line per store at any
    width: names are cut with an ellipsis rather than wrapped."""
    entries = shelf.list_stores()
    total = sum(e.bytes for e in entries)
    if json_out:
        print_json({"stores": [e.to_dict() for e in entries], "bytes": total})
        return
    screen = console()
    if not entries:
        screen.print(Text(f"No stores in {shelf.shelf_dir()}."))
        return
    models = {e.model for e in entries if e.model}
    screen.print(store_table(entries, show_model=len(models) > 1))
    work = sum(e.is_work for e in entries)
    more = f" and {how_many(work, 'interrupted or leftover work folder')}" if work else ""
    stores = how_many(len(entries) - work, "store")
    line = f"{stores}{more}, {human_bytes(total)}, in {one_line(shelf.shelf_dir())}"
    if len(models) == 1:
        line += f"; model {next(iter(models))}"
    screen.print(Text(line, style="dim"), soft_wrap=True)


KEY_SHOWN = 16  # characters of a store's key listed, more where needed to tell keys apart


def store_table(entries: list[StoreEntry], show_model: bool) -> Table:
    """One row per store. Document and model names give way to the width (cut with an
    ellipsis); numbers, ages and keys are never cut."""
    table = Table(box=None, header_style="bold")
    table.add_column("document", ratio=3, min_width=8)
    if show_model:
        table.add_column("model", ratio=2, min_width=8)
    for name in ("tokens", "size", "last used", "key"):
        right = name in ("tokens", "size")
        table.add_column(name, justify="right" if right else "left", no_wrap=True)
    width = shown_key_length([e.key for e in entries])
    now = time.time()
    for e in entries:
        shown = one_line(Path(e.document).name) if e.document else "–"
        name = Text(shown, no_wrap=True, overflow="ellipsis")
        name.append(MARKS.get(e.kind, ""), style="dim")
        model = Text(one_line(e.model or "–"), no_wrap=True, overflow="ellipsis")
        table.add_row(
            name,
            *([model] if show_model else []),
            Text("–" if e.tokens is None else f"{e.tokens:,}"),
            Text(human_bytes(e.bytes)),
            Text(ago(now - e.last_used)),
            Text(e.key[:width]),
        )  # names and keys are text, never markup
    return table


def shown_key_length(keys: list[str]) -> int:
    """The shortest length, at least ``KEY_SHOWN``, at which ``keys`` all differ (a prefix that
    `sekv stores rm` matches to one store)."""
    for n in range(KEY_SHOWN, max(map(len, keys), default=0) + 1):
        if len({k[:n] for k in keys}) == len(set(keys)):
            return n
    return max(map(len, keys), default=KEY_SHOWN)


@stores_app.command("rm")
@handle_errors
def rm(
    target: str = typer.Argument(
        ...,
        metavar="FILE|KEY",
        help="A document (its stores for every model and settings), a store's path, or a store "
        "key or key prefix from `sekv stores list`.",
    ),
    json_out: bool = JSON_OPTION,
) -> None:
    """Remove the stores of a document, or one store by its key."""
    done = shelf.remove(shelf.match(shelf.list_stores(), target))
    if not done.removed and done.busy:
        fail(f"'{target}' names stores being built, kept; try again once they are built")
    report(done, json_out)


@stores_app.command()
@handle_errors
def prune(
    older_than: str | None = typer.Option(
        None,
        "--older-than",
        metavar="AGE",
        help="Also remove stores unused this long: 30d, 12h, 2w (default: no age limit).",
    ),
    max_size: str | None = typer.Option(
        None,
        "--max-size",
        metavar="SIZE",
        help="Then remove the least recently used until the rest fit: 500M, 2G (1G = 1024^3 "
        "bytes; default: no size limit).",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only show what would be removed."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Remove what killed processes left, and stores not used lately or the least recently
    used beyond a total size (without options: only the leftovers)."""
    age = _parsed(shelf.parse_age, older_than, "--older-than")
    size = _parsed(shelf.parse_size, max_size, "--max-size")
    doomed = shelf.plan_prune(shelf.list_stores(), age, size)
    report(Removal(doomed, []) if dry_run else shelf.remove(doomed), json_out, dry_run)


def report(done: Removal, json_out: bool, dry_run: bool = False) -> None:
    """What was removed (stdout) and what was kept because it is being built (warnings)."""
    if json_out:
        print_json(
            {
                "removed": [e.to_dict() for e in done.removed],
                "busy": [e.to_dict() for e in done.busy],
                "bytes": done.bytes,
                "dry_run": dry_run,
            }
        )
    else:
        screen = console(soft_wrap=True)  # one line per store, however long
        verb = "Would remove" if dry_run else "Removed"
        for e in done.removed:
            screen.print(Text(f"{verb} {e.key} ({describe(e)}, {human_bytes(e.bytes)})"))
        if not done.removed and not done.busy:
            screen.print(Text("Nothing to remove."))
        elif done.removed:
            screen.print(Text(f"{verb} {counted(done.removed)}, {human_bytes(done.bytes)}."))
    for e in done.busy:
        warn(f"kept {e.key} ({describe(e)}): it is being built")


NOUNS = {"store": "store", "resumable": "interrupted ingest", "leftover": "leftover work folder"}


def counted(entries: list[StoreEntry]) -> str:
    """``entries`` counted by what they are: ``2 stores``, ``1 store and 1 leftover work
    folder``, ``1 interrupted ingest``."""
    kinds = [e.kind if e.is_work else "store" for e in entries]
    parts = [how_many(kinds.count(k), noun) for k, noun in NOUNS.items() if k in kinds]
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]


MARKS = {"blocks": " (blocks)", "resumable": " (interrupted ingest)", "leftover": " (leftover)"}


def describe(e: StoreEntry) -> str:
    if e.is_work:
        return MARKS[e.kind].strip(" ()") + (f" of {one_line(e.document)}" if e.document else "")
    return f"{one_line(e.document or 'unknown document')}, {one_line(e.model or 'unknown model')}"


def ago(seconds: float) -> str:
    """``seconds`` as a rough age: ``just now``, ``5 min ago``, ``3 h ago``, ``12 days ago``."""
    days = int(seconds // 86400)
    if days:
        return f"{how_many(days, 'day')} ago"
    for unit, size in (("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f} {unit} ago"
    return "just now"


def _parsed(parse, text: str | None, option: str):
    if text is None:
        return None
    try:
        return parse(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None
