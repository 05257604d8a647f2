"""The suite's report: figures per cell and per memory share, the stated goal, Markdown, plots.

:func:`write_report` turns results rows (one per answer, see :mod:`.suite`) into
``summary.json``, ``results.md`` and the PNG plots; :func:`merge_runs` does it for several
runs' rows at once (runs of today's and of older versions: old keys are read too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sekv_core.errors import SekvError

from . import plots
from .rows import config_label, group, mean, upgrade

GOAL_SHARE = 0.15  # SeKV should match full KV at or below this resident share
MEMORY_SLACK = 1.1  # SeKV may hold 10% more resident memory than a baseline it is compared with


def write_report(
    out: Path, model: str, config: dict[str, Any], rows: list[dict], errors: list[dict]
) -> dict[str, Any]:
    """summary.json, results.md and the plots of ``rows`` into ``out``; returns the summary."""
    files = {"results": "results.jsonl", "summary": "summary.json", "table": "results.md"}
    if plots.accuracy_vs_memory(by_share(rows), out / "accuracy_vs_memory.png"):
        files["accuracy_vs_memory"] = "accuracy_vs_memory.png"
    if plots.needle_heatmap(rows, out / "needle_heatmap.png"):
        files["needle_heatmap"] = "needle_heatmap.png"
    summary = {
        "model": model,
        "config": config,
        "rows": len(rows),
        "cells": cells(rows),
        "by_memory_share": by_share(rows),
        "goal": goal(rows),
        "errors": errors,
        "files": files,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "results.md").write_text(markdown(summary))
    return summary


def merge_runs(runs: list[Path], out: Path) -> dict[str, Any]:
    """One report from several runs' directories (e.g. methods run at different times):
    their results.jsonl rows are concatenated into ``out``, older runs' keys renamed to today's
    (``budget`` -> ``memory_share``, ``resident_ratio`` -> ``resident_share``, ...)."""
    rows, errors, model = [], [], None
    for run in runs:
        try:
            lines = (run / "results.jsonl").read_text().splitlines()
            summary = json.loads((run / "summary.json").read_text())
        except (OSError, ValueError) as exc:
            raise SekvError(f"{run} is not a finished `sekv bench` run ({exc})") from None
        if model is not None and summary["model"] != model:
            raise SekvError(f"{run} was run with {summary['model']}, not {model}; merge one model")
        model = summary["model"]
        rows += [upgrade(json.loads(line)) for line in lines if line.strip()]
        errors += [upgrade(e) for e in summary.get("errors", [])]
    if not rows:
        raise SekvError("no rows to report; give directories of `sekv bench` runs")
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.jsonl").open("w") as sink:
        sink.writelines(json.dumps(r) + "\n" for r in rows)

    def values(key: str) -> list:
        return sorted({r[key] for r in rows if r.get(key) is not None})

    config = {
        "methods": list(dict.fromkeys(r["method"] for r in rows)),
        "tasks": list(dict.fromkeys(r["task"] for r in rows)),
        "lengths": values("target_length"),
        "depths": values("depth"),
        "memory_shares": values("memory_share"),
        "seeds": values("seed"),
        "merged_from": [str(r) for r in runs],
    }
    return write_report(out, model, config, rows, errors)


def figures(rows: list[dict]) -> dict[str, Any]:
    """Accuracy (mean score, RULER's figure), exact (share fully correct), memory, timings."""
    built = [r for r in rows if not r["cache_hit"]]
    return {
        "n": len(rows),
        "accuracy": mean(r["score"] for r in rows),
        "exact": mean(float(r["correct"]) for r in rows),
        "resident_share": mean(r["resident_share"] for r in rows),
        "store_share": mean(r["store_share"] for r in rows),
        "ingest_s": mean(r["ingest_s"] for r in built),
        "first_token_s": mean(r["first_token_s"] for r in rows),
        "decode_tps": mean(r["decode_tps"] for r in rows),
        # span routing (SeKV methods; None elsewhere)
        "zoom_rate": mean(r.get("routing", {}).get("zoom_rate") for r in rows),
        "recall_vs_oracle": mean(r.get("routing", {}).get("recall_vs_oracle") for r in rows),
        "mass_captured": mean(r.get("routing", {}).get("mass_captured") for r in rows),
        "oracle_mass_captured": mean(
            r.get("routing", {}).get("oracle_mass_captured") for r in rows
        ),
    }


def cells(rows: list[dict]) -> list[dict]:
    """Figures per method × memory share × task × target length."""
    return [
        {"method": m, "memory_share": s, "task": t, "length": n} | figures(rs)
        for (m, s, t, n), rs in group(rows, "task", "target_length").items()
    ]


def by_share(rows: list[dict]) -> list[dict]:
    """Figures per method × memory share over all tasks (what the accuracy-vs-memory plot
    draws)."""
    return [{"method": m, "memory_share": s} | figures(rs) for (m, s), rs in group(rows).items()]


def goal(rows: list[dict]) -> dict[str, Any]:
    """The stated goal, checked per task and memory share. Each SeKV variant (``sekv*``) must
    be at least as accurate as every baseline run at the same memory share *without holding
    more resident memory* (measured, ``MEMORY_SLACK`` allowed), and as accurate as full KV
    wherever its measured resident share is at most ``GOAL_SHARE``. Lists every comparison and
    misses."""
    acc = {k: figures(rs) for k, rs in group(rows, "task").items()}
    methods = {m for m, _, _ in acc}
    sekvs = sorted(m for m in methods if m.startswith("sekv"))
    others = sorted(m for m in methods if m not in sekvs and m != "full")
    checks = []
    for (method, share, task), f in acc.items():
        if method not in sekvs or share is None:
            continue
        rivals = [(o, share) for o in others]
        if f["resident_share"] <= GOAL_SHARE:
            rivals.append(("full", None))
        for rival in rivals:
            if (g := acc.get((*rival, task))) is None:
                continue
            why = []
            if f["accuracy"] < g["accuracy"]:
                why.append("lower accuracy")
            if rival[0] != "full" and f["resident_share"] > g["resident_share"] * MEMORY_SLACK:
                why.append("more resident memory")
            checks.append(
                {
                    "task": task,
                    "sekv": config_label(method, share),
                    "rival": config_label(*rival),
                    "sekv_accuracy": f["accuracy"],
                    "rival_accuracy": g["accuracy"],
                    "sekv_resident": f["resident_share"],
                    "rival_resident": g["resident_share"],
                    "holds": not why,
                    "why": ", ".join(why),
                }
            )
    notes = [] if sekvs else ["no SeKV method in the run"]
    notes += [] if others else ["no baseline run at a memory share"]
    for m in sekvs:
        lowest = min(
            (f["resident_share"] for (k, s, _), f in acc.items() if k == m and s), default=1
        )
        if lowest > GOAL_SHARE:
            notes.append(
                f"{m} never got to <= {GOAL_SHARE:.0%} resident (lowest measured {lowest:.1%}), "
                "so the comparison with full KV was not made"
            )
    misses = [c for c in checks if not c["holds"]]
    untested = any("never got" in n for n in notes)
    return {
        "checked": len(checks),
        "holds": bool(checks) and not misses and not untested,
        "checks": checks,
        "misses": misses,
        "notes": notes,
    }


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.1%}"


def _num(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _held(x: dict[str, Any]) -> str:
    """The exact span attention the picks held, with the oracle's in brackets."""
    if x.get("mass_captured") is None:
        return "–"
    return f"{_num(x['mass_captured'])} ({_num(x['oracle_mass_captured'])})"


def _table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines])


def markdown(summary: dict[str, Any]) -> str:
    """The results as Markdown: per-cell table, per-share table, the goal and its misses."""
    c = summary["config"]
    parts = [
        f"# sekv bench: {summary['model']}",
        f"Methods {', '.join(c['methods'])}; tasks {', '.join(c['tasks'])}; lengths "
        f"{', '.join(map(str, c['lengths']))}; depths {', '.join(map(str, c['depths']))}; "
        f"memory shares {', '.join(map(str, c['memory_shares']))}; "
        f"seeds {', '.join(map(str, c['seeds']))}; "
        f"{summary['rows']} answers. Accuracy: mean string-match score (RULER; partial credit "
        "when several strings are expected); exact: share fully right. Resident / store: bytes "
        "as measured, over the fp16 full KV cache. Ingest s: prepare time of sessions that built "
        "their memory (store cache misses).",
        "## Per method, task and length",
        _table(
            ["method", "memory", "task", "length", "n", "accuracy", "exact", "resident", "store"]
            + ["ingest s", "first token s", "decode tok/s"],
            [
                [x["method"], _num(x["memory_share"]), x["task"], str(x["length"]), str(x["n"])]
                + [_num(x["accuracy"]), _num(x["exact"]), _pct(x["resident_share"])]
                + [_pct(x["store_share"]), _num(x["ingest_s"]), _num(x["first_token_s"], 3)]
                + [_num(x["decode_tps"], 1)]
                for x in summary["cells"]
            ],
        ),
        "## Per method and memory share (all tasks)",
        _table(
            ["method", "memory", "n", "accuracy", "exact", "resident", "store"]
            + ["zoom rate", "recall vs oracle", "mass held (oracle's)"],
            [
                [x["method"], _num(x["memory_share"]), str(x["n"]), _num(x["accuracy"])]
                + [_num(x["exact"]), _pct(x["resident_share"]), _pct(x["store_share"])]
                + [_pct(x["zoom_rate"])]
                + [_num(x["recall_vs_oracle"])]
                + [_held(x)]
                for x in summary["by_memory_share"]
            ],
        ),
        "## Goal",
        f"SeKV ≥ every baseline's accuracy at equal resident memory (same memory share; "
        f"measured shares shown), and equal to full KV at ≤ {GOAL_SHARE:.0%} resident. "
        + _goal_line(summary["goal"]),
    ]
    if summary["goal"]["misses"]:
        parts.append(
            _table(
                [
                    "task",
                    "sekv",
                    "rival",
                    "why",
                    "sekv acc",
                    "rival acc",
                    "sekv resident",
                    "rival resident",
                ],
                [
                    [m["task"], m["sekv"], m["rival"], m["why"], _num(m["sekv_accuracy"])]
                    + [_num(m["rival_accuracy"]), _pct(m["sekv_resident"])]
                    + [_pct(m["rival_resident"])]
                    for m in summary["goal"]["misses"]
                ],
            )
        )
    if summary["errors"]:
        parts.append("## Runs that failed")
        parts += [
            f"- {e['sample']} {config_label(e['method'], e['memory_share'])}: {e['error']}"
            for e in summary["errors"]
        ]
    pngs = [f for f in summary["files"].values() if f.endswith(".png")]
    if pngs:
        parts.append("## Plots\n\n" + "\n".join(f"![{p[:-4]}]({p})" for p in pngs))
    return "\n\n".join(parts) + "\n"


def _goal_line(g: dict[str, Any]) -> str:
    notes = "".join(f" Note: {n}." for n in g["notes"])
    if not g["checked"]:
        return "Not shown: nothing to compare." + notes
    if g["misses"]:
        return (
            f"Does not hold: SeKV falls short in {len(g['misses'])} of {g['checked']} "
            f"comparisons (per task and memory share), listed below.{notes}"
        )
    verdict = "Holds" if g["holds"] else "Not fully shown"
    return f"{verdict}: SeKV is ahead or level in all {g['checked']} comparisons.{notes}"
