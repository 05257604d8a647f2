"""Rich rendering of answers' explanations (zoom traces, memory)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from sekv_core.html_report import human_bytes

if TYPE_CHECKING:
    from sekv_core.engine import Answer

__all__ = ["human_bytes", "print_rows", "print_zoom"]

out = Console()
SHOWN = 8  # spans listed in the terminal (all are in --json)


def print_zoom(result: Answer) -> None:
    mem = result.memory
    if not result.zoom:
        out.print(f"[dim]No spans zoomed (method {result.method} keeps token-level KV).[/dim]")
    else:
        table = Table(title="Zoomed spans, by the attention they received", expand=True)
        table.add_column("span", justify="right")
        table.add_column("page", justify="right")
        table.add_column("tokens", no_wrap=True)
        table.add_column("attn", justify="right")
        table.add_column("layers/heads", justify="right")
        table.add_column("score / thr", no_wrap=True)
        table.add_column("preview", min_width=30, ratio=1)
        for z in result.zoom[:SHOWN]:
            table.add_row(
                str(z["span"]),
                str(z.get("page", "")),
                f"{z['start']}–{z['end']}",
                f"{z['attention']:.1%}",
                f"{z['layers']}/{z['heads']}",
                f"{z['score']:.1f} / {z['threshold']:.1f}",
                z.get("preview", ""),
            )
        out.print(table)
        if len(result.zoom) > SHOWN:
            out.print(
                f"[dim]… and {len(result.zoom) - SHOWN} more spans zoomed less (--json)[/dim]"
            )
    if result.routing:
        r = result.routing
        rule = "gate > 0" if r["margin"] is None else f"margin {r['margin']:g}"
        if r.get("neighbours"):
            rule += f", {r['neighbours']} neighbour(s) on each side"
        out.print(
            f"routing: {r['router']} router, budget {r['budget']} tokens per layer and head, "
            f"{rule}; at most {r['zoomed_tokens_max']} tokens zoomed"
        )
    out.print(
        f"memory: resident {human_bytes(mem['resident_bytes'])} (incl. zoom peak), offloaded "
        f"{human_bytes(mem['offloaded_bytes'])}, full KV {human_bytes(mem['full_kv_bytes'])}"
    )


def print_rows(title: str, rows: list[dict]) -> None:
    """A table of benchmark rows (dicts with the same keys)."""
    table = Table(title=title)
    for col in rows[0]:
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    out.print(table)
