"""`sekv inspect`: show how a document was cut into spans, what each span costs, and where."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table
from rich.text import Text

from sekv_core.threads import resolve_threads

from .errors import handle_errors
from .html_report import render_html, scale_top
from .html_style import INK, SCALE
from .loading import open_store
from .options import MAX_TOKENS_OPTION, MODEL_OPTION, THREADS_OPTION
from .output import check_writable, print_json, write_output
from .terminal import console, err, one_line
from .words import how_many, human_bytes

TEXT_LIMIT = 4000  # document tokens shown on the terminal; the table always lists every span
SPAN_MARK = "│"


@handle_errors
def inspect(
    file: Path = typer.Argument(..., help="Document to inspect: .pdf, .txt or .md."),
    model: str | None = MODEL_OPTION,
    json_out: bool = typer.Option(
        False, "--json", help="Print the whole report (spans, tokens, bytes) as one JSON object."
    ),
    html_out: Path | None = typer.Option(
        None,
        "--html",
        metavar="OUT",
        help="Write a self-contained HTML page of the report to OUT (no network needed).",
    ),
    max_tokens: int = MAX_TOKENS_OPTION,
    threads: int | None = THREADS_OPTION,
) -> None:
    """Show FILE's span segmentation: text coloured by surprisal, spans, anchors, bytes."""
    if html_out is not None:
        check_writable(html_out, [file])
    loaded, document, _, store, _, _ = open_store(file, model, resolve_threads(threads), max_tokens)
    from sekv_core.report import build_report  # torch: loaded by now

    report = build_report(store, document, loaded.tokenizer)
    if html_out is not None:
        write_output(html_out, render_html(report))
        err.print(Text(f"wrote {one_line(html_out)}"), soft_wrap=True)
    if json_out:
        print_json(report)
        return
    out = console()
    out.print(_header(report), highlight=False)
    if html_out is None:
        out.print(_text(report, plain=out.color_system is None))
        out.print(_table(report))
    out.print(_summary(report), highlight=False)


def _header(report: dict[str, Any]) -> Text:
    doc, st = report["document"], report["stats"]
    sl = st["span_len"]
    return Text(one_line(doc["name"]), style="bold") + Text(
        f" · {report['model']} · {how_many(doc['tokens'], 'token')}, "
        f"{how_many(doc['pages'], 'page')} · {how_many(st['spans'], 'span')} "
        f"(length p50 {sl['p50']:g}, {sl['min']}–{sl['max']}) · "
        f"{how_many(st['anchors'], 'anchor')} "
        f"({st['anchors_pct']:g}%) · threshold {st['threshold_nats']:.2f} nats"
    )


def _text(report: dict[str, Any], plain: bool = False) -> Text:
    """Document text: surprisal as background, `│` before each span, anchors in blue.

    Without colours (``plain``) anchors are bracketed «like this» instead.
    """
    doc_start = report["document"]["doc_start"]
    tokens = report["tokens"][doc_start:]
    top = scale_top(report)
    styles = ["", ""] + [f"{ink} on {bg}" for bg, ink in zip(SCALE[2:], INK[2:], strict=True)]
    text = Text()
    current = None
    for t in tokens[:TEXT_LIMIT]:
        piece = t["text"]
        starts_span = t["span"] is not None and t["span"] != current
        if starts_span or t["role"] == "anchor":  # marks go after leading whitespace
            lead = piece[: len(piece) - len(piece.lstrip())]
            text.append(lead)
            piece = piece[len(lead) :]
        if starts_span:
            text.append(SPAN_MARK, style="bold cyan")
        current = t["span"]
        if t["role"] == "anchor":
            style = "bold white on blue"
            piece = f"«{piece}»" if plain else piece
        elif t["role"] == "sink":
            style = "dim italic"
        else:
            level = int(len(SCALE) * t["surprisal"] / top)
            style = styles[max(0, min(len(SCALE) - 1, level))]
        text.append(piece, style=style)
    if len(tokens) > TEXT_LIMIT:
        text.append(
            f"\n… {how_many(len(tokens) - TEXT_LIMIT, 'more token')} (the table lists every span; "
            "--html OUT shows the whole text)",
            style="dim",
        )
    text.append("\n\n")
    text.append("legend: ", style="dim")
    text.append(SPAN_MARK, style="bold cyan")
    text.append(" span start  ")
    text.append("«anchor»" if plain else "anchor", style="bold white on blue")
    text.append("  ")
    text.append("sink", style="dim italic")
    text.append("  surprisal: low ")
    for bg, ink in zip(SCALE[2:], INK[2:], strict=True):
        text.append("  ", style=f"{ink} on {bg}")
    text.append(f" {top:.1f}+ nats")
    return text


def _table(report: dict[str, Any]) -> Table:
    table = Table(title="Spans", title_justify="left", header_style="bold")
    for name, justify in (
        ("span", "right"),
        ("tokens", "left"),
        ("page", "right"),
        ("len", "right"),
        ("offloaded", "right"),
        ("preview", "left"),
    ):
        # numbers never wrap; the preview gives way (one line per span, cut with an ellipsis)
        table.add_column(name, justify=justify, no_wrap=name != "preview", min_width=len(name))
    for s in report["spans"]:
        table.add_row(
            str(s["id"]),
            f"{s['start']}–{s['end']}",
            str(s["page"]),
            str(s["length"]),
            human_bytes(s["offloaded_bytes"]),
            Text(s["preview"], no_wrap=True, overflow="ellipsis"),
        )
    return table


def _summary(report: dict[str, Any]) -> Text:
    b, r = report["bytes"], report["ratios"]
    return Text("memory", style="bold") + Text(
        f": resident {human_bytes(b['resident'])} "
        f"({r['resident']:.1%} of fp16 full KV) · offloaded {human_bytes(b['offloaded'])} "
        f"({r['offloaded']:.1%}) · trace {human_bytes(b['trace'])} · on disk "
        f"{human_bytes(b['store'])} ({r['store']:.1%}) · full KV "
        f"{human_bytes(b['full_kv_fp16'])} fp16, {human_bytes(b['full_kv_fp32'])} fp32"
    )
