"""Rich rendering of answers' explanations (zoom traces, memory)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from sekv_core.engine import Answer

out = Console()


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def print_zoom(result: Answer) -> None:
    mem = result.memory
    if not result.zoom:
        out.print(f"[dim]No spans zoomed (method {result.method} keeps token-level KV).[/dim]")
    else:
        table = Table(title="Zoomed spans")
        for col in ("span", "page", "tokens", "layers×heads", "score / threshold", "preview"):
            table.add_column(col)
        for z in result.zoom:
            table.add_row(
                str(z["span"]),
                str(z.get("page", "")),
                f"{z['start']}–{z['end']}",
                str(z.get("heads", "")),
                f"{z.get('score', 0):.2f} / {z.get('threshold', 0):.2f}",
                z.get("preview", ""),
            )
        out.print(table)
    out.print(
        f"memory: resident {human_bytes(mem['resident_bytes'])}, offloaded "
        f"{human_bytes(mem['offloaded_bytes'])}, full KV {human_bytes(mem['full_kv_bytes'])}"
    )
