"""The suite's PNG plots (matplotlib, drawn off-screen: no display or pyplot state needed).

- :func:`accuracy_vs_memory`: accuracy against the measured resident share, one line per method
  across memory shares (methods that follow none, such as full KV, are single points);
- :func:`needle_heatmap`: needle accuracy over depth × length, one panel per method and memory
  share.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def accuracy_vs_memory(by_share: list[dict[str, Any]], path: Path) -> bool:
    """Plot rows of ``{method, accuracy, resident_share}``; False if there is nothing."""
    points: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in by_share:
        if r["accuracy"] is not None and (r["resident_share"] or 0) > 0:  # log axis
            points[r["method"]].append((r["resident_share"], r["accuracy"]))
    if not points:
        return False
    fig = _figure(7, 4.5)
    ax = fig.add_subplot()
    for method, xy in points.items():
        xy.sort()
        xs, ys = zip(*xy, strict=True)
        single = len(xy) == 1  # a method that follows no share (full KV): one point
        style = dict(marker="*", markersize=14, linestyle="none") if single else dict(marker="o")
        ax.plot(xs, ys, label=method, **style)
    _share_axis(ax, [x for xy in points.values() for x, _ in xy])
    ax.set_xlabel("resident memory / full KV cache (fp16), measured")
    ax.set_ylabel("accuracy (string match)")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title("Accuracy vs resident memory")
    fig.savefig(path)
    return True


def _share_axis(ax, shares: list[float]) -> None:
    """A log x axis of shares with percent ticks (targets of a few % and full KV at 100%)."""
    from matplotlib.ticker import FixedLocator, NullFormatter, PercentFormatter

    ax.set_xscale("log")
    lo, hi = min(shares) / 1.3, max(shares) * 1.3
    ticks = [t * 10**e for e in range(-3, 2) for t in (1, 2, 5)]
    ax.set_xlim(lo, hi)
    ax.xaxis.set_major_locator(FixedLocator([t for t in ticks if lo <= t <= hi] or [lo, hi]))
    ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=None))
    ax.xaxis.set_minor_formatter(NullFormatter())


def needle_heatmap(rows: list[dict[str, Any]], path: Path) -> bool:
    """Needle accuracy per depth × target length; False if the rows hold no needle task."""
    needle = [r for r in rows if r["task"] == "needle"]
    if not needle:
        return False
    depths = sorted({r["depth"] for r in needle})
    lengths = sorted({r["target_length"] for r in needle})
    methods = list(dict.fromkeys(r["method"] for r in needle))
    shares = list(dict.fromkeys(r["memory_share"] for r in needle))
    shares = [s for s in shares if s is not None]
    cols = max(1, len(shares))
    scores: dict[tuple, list[float]] = defaultdict(list)
    for r in needle:
        scores[(r["method"], r["memory_share"], r["depth"], r["target_length"])].append(r["score"])
    fig = _figure(
        1.2 + cols * (1 + 0.7 * len(lengths)), 0.6 + len(methods) * (1 + 0.4 * len(depths))
    )
    axes = fig.subplots(len(methods), cols, squeeze=False)
    image = None
    for i, method in enumerate(methods):
        runs = [b for b in shares if (method, b) in {(k[0], k[1]) for k in scores}] or [None]
        for j in range(cols):
            ax = axes[i][j]
            if j >= len(runs):
                ax.set_axis_off()
                continue
            b = runs[j]
            grid = [[_mean(scores.get((method, b, d, n))) for n in lengths] for d in depths]
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
            for y, line in enumerate(grid):
                for x, v in enumerate(line):
                    if v == v:  # not NaN
                        ax.text(
                            x,
                            y,
                            f"{v:.2f}",
                            ha="center",
                            va="center",
                            fontsize=7,
                            color="black" if v > 0.5 else "white",
                        )
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
            ax.set_title(method if b is None else f"{method} @ {b:g}", fontsize=9)
            if j == 0:
                ax.set_ylabel("depth")
            if i == len(methods) - 1:
                ax.set_xlabel("length (tokens)")
    fig.colorbar(image, ax=axes, shrink=0.8, label="accuracy")
    fig.suptitle("Needle accuracy: depth × length")
    fig.savefig(path)
    return True


def _mean(values: list[float] | None) -> float:
    return sum(values) / len(values) if values else float("nan")
