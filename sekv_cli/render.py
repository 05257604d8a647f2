"""Rich rendering of answers' explanations: sources, the zoom in plain words, diagnostics.

Document text is never read as Rich markup: it goes into ``Text`` objects, styled by range.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich import box
from rich.table import Table
from rich.text import Text

from .terminal import console, one_line
from .words import how_many, human_bytes, zoom_words

if TYPE_CHECKING:
    from sekv_core.engine import Answer

__all__ = ["print_rows", "print_sources", "print_zoom"]

out = console(highlight=False, soft_wrap=True)  # lines the terminal wraps, pipes keep whole
SHOWN = 8  # spans listed by --verbose (all are in --json)


def emphasised(text: str, words: list[str], style: str = "bold") -> Text:
    """``text`` as plain Text with each whole occurrence of ``words`` in ``style``."""
    rich = Text(text)
    for word in words:
        for m in re.finditer(rf"(?<!\w){re.escape(word)}(?!\w)", text):
            rich.stylize(style, m.start(), m.end())
    return rich


def source_line(n: int, source: dict[str, Any], with_file: bool = False) -> Text:
    """``[1] p. 5  "…quote…"`` with the words it shares with the answer in bold (``with_file``:
    ``[1] notes/a.pdf p. 5  "…"``, for a collection's answer)."""
    page = f"p. {source['page']}"
    where = f"{one_line(source['path'])} {page}" if with_file else page
    line = Text(f"[{n}] {where}  ", style="cyan")
    line.append('"')
    line.append_text(emphasised(source["text"], source.get("matched", [])))
    line.append('"')
    return line


def print_sources(result: Answer, with_files: bool = False) -> None:
    """The answer's sources, best first (nothing for methods that do not record them);
    ``with_files``: each with its file."""
    if not result.sources:
        return
    out.print(Text("Sources", style="bold"))
    for n, source in enumerate(result.sources, 1):
        out.print(source_line(n, source, with_files))


def print_zoom(result: Answer, verbose: bool = False) -> None:
    """Per source, its share of the answer's attention and why it was zoomed; the zoom and
    memory in one line each. ``verbose``: the router's diagnostics per zoomed span too."""
    for n, source in enumerate(result.sources, 1):
        line = Text(f"[{n}] ", style="cyan")
        line.append(f"{source['share']:.0%} of the answer's attention on the document")
        if facts := source.get("zoom"):
            line.append(f"; {zoom_words(facts)}")
        out.print(line)
    if not result.zoom:
        out.print(Text(f"No spans zoomed (method {result.method} keeps token-level KV).", "dim"))
    elif result.routing:
        r, tokens = result.routing, result.document["tokens"]
        out.print(
            Text(
                f"zoom: at most {r['zoomed_tokens_max']:,} of the document's "
                f"{how_many(tokens, 'token')} per layer and KV head, {router_words(r)}"
            )
        )
    mem = result.memory
    out.print(
        f"memory: resident {human_bytes(mem['resident_bytes'])} (incl. zoom peak), offloaded "
        f"{human_bytes(mem['offloaded_bytes'])} (host), full KV {human_bytes(mem['full_kv_bytes'])}"
    )
    if ranked := result.routing.get("documents"):
        print_routed(ranked, mem, result.routing.get("read_together"))
    if verbose:
        print_diagnostics(result)


def router_words(routing: dict[str, Any]) -> str:
    """Which router routed: ``trained router <file>`` (the one shipped with sekv named so),
    or ``training-free router``."""
    from sekv_core.router_files import SHIPPED  # an answer's: torch is loaded by now

    where = ""
    if file := routing.get("router_file"):
        where = " (shipped)" if Path(file).parent == SHIPPED else f" {one_line(file)}"
    return f"{routing['router']} router{where}"


def print_routed(
    ranked: list[dict[str, Any]], mem: dict[str, int], together: list[str] | None = None
) -> None:
    """A collection's answer: the documents ranked first, each with its score, why (its best
    passage's words, meaning or both), how likely the model found the question after that
    passage (when it read it), the question's part it was ranked for, and that passage; those
    read together marked ``*``; the resident memory of the stores held against that of all."""
    read = set(together or [])
    out.print(Text(f"documents (* read for this answer; {len(read)} read together):"))
    for row in ranked:
        mark = "*" if row["path"] in read else " "
        line = Text(f"{mark} {one_line(row['path'])} ")
        model = "" if row.get("model") is None else f", model {row['model']:.2f}"
        part = f' for "{row["part"]}"' if row.get("part") else ""
        line.append(
            f"{row['score']:.2f} by {row['why']} (meaning {row['meaning']:.2f}, words "
            f"{row['words']:.2f}{model}){part}, p. {row['page']}: ",
            style="dim",
        )
        line.append(preview(row.get("passage", "")))
        out.print(line, no_wrap=True, overflow="ellipsis")
    if "held_resident_bytes" in mem:
        out.print(
            f"stores held: resident {human_bytes(mem['held_resident_bytes'])}; every store "
            f"known at once {human_bytes(mem['collection_resident_bytes'])}, full KV of the "
            f"documents read {human_bytes(mem['collection_full_kv_bytes'])}"
        )


def preview(text: str, width: int = 90) -> str:
    """``text`` on one line, quoted, cut at ``width`` characters."""
    flat = " ".join(text.split())
    return f'"{flat[:width]}{"…" if len(flat) > width else ""}"'


def print_diagnostics(result: Answer) -> None:
    """The router's view: spans by the attention they received, scores against thresholds."""
    if result.zoom:
        shown = result.zoom[:SHOWN]
        beside = out.width >= FIGURES_WIDTH + PREVIEW_MIN
        out.print(zoom_table(shown, beside))
        if not beside:  # a narrow terminal: each preview on a line of its own
            for z in shown:
                line = Text(f"span {z['span']}: ", style="cyan", no_wrap=True, overflow="ellipsis")
                out.print(line + Text(z.get("preview", "")), no_wrap=True, overflow="ellipsis")
        if len(result.zoom) > SHOWN:
            more = how_many(len(result.zoom) - SHOWN, "more zoomed span")
            out.print(Text(f"… and {more} (--json)", "dim"))
    if result.routing:
        r = result.routing
        rule = "gate > 0" if r["margin"] is None else f"margin {r['margin']:g}"
        if r.get("neighbours"):
            rule += f", {r['neighbours']} neighbour(s) on each side"
        out.print(
            Text(
                f"routing: {router_words(r)}, budget {how_many(r['budget'], 'token')} per "
                f"layer and head, {rule}; {r['reconstructions']:,} span reconstructions, zoom "
                f"rate {r['zoom_rate']:.1%}"
            )
        )


PREVIEW_MIN = 16  # columns a preview keeps beside the figures; narrower: previews below
FIGURES_WIDTH = 54  # the figures' columns as printed, padding included


def zoom_table(zoom: list[dict[str, Any]], beside: bool = True) -> Table:
    """The zoomed spans, one line each: span, page, token range, attention, layers and
    layer-heads that zoomed it, best score / threshold and, ``beside`` them, a preview of its
    text cut to the width left."""
    table = Table(
        title="Zoomed spans, by the attention they received",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
        expand=True,
    )
    for col, justify in [
        ("span", "right"),
        ("page", "right"),
        ("tokens", "left"),
        ("attn", "right"),
        ("layers", "right"),
        ("heads", "right"),
        ("score/thr", "left"),
    ]:
        table.add_column(col, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    if beside:
        table.add_column("preview", ratio=1, min_width=PREVIEW_MIN, no_wrap=True)
    for z in zoom:
        preview = Text(z.get("preview", ""), no_wrap=True, overflow="ellipsis")
        table.add_row(
            str(z["span"]),
            str(z.get("page", "")),
            f"{z['start']}–{z['end']}",
            f"{z['attention']:.1%}",
            str(z["layers"]),
            str(z["heads"]),
            f"{z['score']:.1f}/{z['threshold']:.1f}",
            *([preview] if beside else []),
        )
    return table


def print_rows(title: str, rows: list[dict]) -> None:
    """A table of benchmark rows (dicts with the same keys)."""
    table = Table(title=title)
    for col in rows[0]:
        table.add_column(col)
    for row in rows:
        table.add_row(*(Text(str(v)) for v in row.values()))  # names are text, not markup
    out.print(table)
