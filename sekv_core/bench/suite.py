"""The benchmark suite: every method × resident-memory budget on every task sample, side by side.

For each sample document and each (method, budget) one :class:`~sekv_core.engine.Session` is
prepared and answers all the sample's questions; each answer is one row of ``results.jsonl``
(appended as it goes). Budgets are resident-memory targets as a share of the document's fp16
full KV cache (``MethodSettings.memory_ratio``); every row reports the ratio as *measured*
(``resident_fp16_bytes / full_kv_bytes_fp16``), since a method may overshoot its target. Methods
whose memory does not depend on the budget (``full``, or ``budgeted = False``) run once per
document. Generated documents are kept under ``out/samples/`` (``sekv ask`` can replay them).
:meth:`Suite.finish` writes ``summary.json``, ``results.md`` and the plots.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..documents import Document, load_document
from ..engine import Session
from ..errors import SekvError
from ..methods import METHODS, MethodSettings
from ..models import LoadedModel
from ..store import StoreSettings
from ..zoom import KV_BITS
from . import plots, resident_share
from .score import is_correct, score
from .tasks import GENERATED, TASKS, Sample, make_sample, qa_samples

ANSWER_CHARS = 160  # answers are truncated in results.jsonl
QUESTION_ROOM = 128  # tokens a target length leaves for the prompt head and the question
GOAL_RATIO = 0.15  # SeKV should match full KV at or below this resident ratio
MEMORY_SLACK = 1.1  # SeKV may hold 10% more resident memory than a baseline it is compared with


@dataclass
class SuiteConfig:
    methods: list[str]
    tasks: list[str]
    lengths: list[int]
    depths: list[float]
    budgets: list[float]
    seeds: list[int]
    max_new_tokens: int = 48
    recall: bool = False  # SeKV methods also run the oracle router: routing recall vs oracle
    qa_docs: list[Path] | None = None  # default: the sample documents
    trained_router: str = "auto"  # sekv-trained's router (auto: the one trained for the model)
    kv_bits: int = KV_BITS  # SeKV's token-level K/V on the device: 8 or 16 bits
    span_tokens: tuple[int, int] | None = None  # SeKV stores' span lengths (min, max)
    neighbours: int | None = None  # SeKV: spans zoomed with each winner on each side
    near: float | None = None  # SeKV: the near spans' share of the zoom budget

    def check(self, window: int | None = None) -> None:
        """Raise SekvError naming the first setting a user must fix (lengths need ``window``)."""
        for kind, given, known in (("method", self.methods, METHODS), ("task", self.tasks, TASKS)):
            if not given:
                raise SekvError(f"no {kind}s given; choose from {', '.join(known)}")
            for name in given:
                if name not in known:
                    raise SekvError(f"unknown {kind} '{name}'; choose from {', '.join(known)}")
        if any(t in GENERATED for t in self.tasks) and not (self.lengths and self.depths):
            raise SekvError("generated tasks need at least one length and one depth")
        for n in self.lengths:
            if n < 64:
                raise SekvError(f"length {n} is too short; use at least 64 tokens")
            longest = window - QUESTION_ROOM - self.max_new_tokens if window else n
            if n > longest:
                raise SekvError(
                    f"length {n} does not fit the model's {window:,}-token window with room for "
                    f"the question and answer; use at most {longest} tokens"
                )
        for d in self.depths:
            if not 0 <= d <= 1:
                raise SekvError(f"depth {d} out of range; depths are relative positions in 0..1")
        for b in self.budgets:
            if not 0 < b <= 1:
                raise SekvError(f"budget {b} out of range; budgets are shares of full KV in (0, 1]")
        if not self.budgets and any(budgeted(m) for m in self.methods):
            raise SekvError("no budgets given for budgeted methods; e.g. --budgets 0.1,0.2")
        if not self.seeds:
            raise SekvError("no seeds given; e.g. --seeds 1")


def budgeted(method: str) -> bool:
    """Whether the method's resident memory follows ``memory_ratio`` (full KV's does not)."""
    return method != "full" and getattr(METHODS[method], "budgeted", True)


def build_samples(config: SuiteConfig, tokenizer) -> list[Sample]:
    samples = [
        make_sample(task, tokenizer, n, d, seed)
        for task in config.tasks
        if task in GENERATED
        for n in config.lengths
        for d in config.depths
        for seed in config.seeds
    ]
    if "qa" in config.tasks:
        samples += qa_samples(tokenizer, config.qa_docs)
    return samples


class Suite:
    """Plans the runs (sample × method × budget); :meth:`run` answers, :meth:`finish` reports."""

    def __init__(self, loaded: LoadedModel, config: SuiteConfig, out: Path) -> None:
        config.check(loaded.spec.window)
        self.loaded, self.config, self.out = loaded, config, Path(out)
        self.samples = build_samples(config, loaded.tokenizer)
        self.configs = [
            (method, budget)
            for method in config.methods
            for budget in (config.budgets if budgeted(method) else [None])
        ]
        self.total = len(self.configs) * sum(len(s.questions) for s in self.samples)
        self.rows: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []

    def run(
        self,
        on_row: Callable[[dict[str, Any]], None] | None = None,
        on_sample: Callable[[str], None] | None = None,
    ) -> dict[str, Any]:
        """Answer every question for every (method, budget); return the summary.

        Rows are appended to results.jsonl as they come. A run a method refuses (SekvError)
        is recorded in the summary's errors. ``on_row`` sees each row, ``on_sample`` a status
        line per sample done.
        """
        (self.out / "samples").mkdir(parents=True, exist_ok=True)
        with (self.out / "results.jsonl").open("w") as sink:  # a new run starts a new file
            for sample in self.samples:
                document = load_document(self.document_path(sample))
                for method, budget in self.configs:
                    try:
                        for row in self.answer(sample, document, method, budget):
                            sink.write(json.dumps(row) + "\n")
                            sink.flush()
                            self.rows.append(row)
                            if on_row:
                                on_row(row)
                    except SekvError as exc:
                        self.errors.append(
                            {"sample": sample.name, "method": method, "budget": budget}
                            | {"error": str(exc)}
                        )
                if on_sample:
                    on_sample(self.status(sample))
        return self.finish()

    def document_path(self, sample: Sample) -> Path:
        """The sample's file: its source, or the generated text written under ``out/samples``."""
        if sample.source is not None:
            return sample.source
        path = self.out / "samples" / f"{sample.name}.txt"
        path.write_text(sample.text)
        return path

    def answer(
        self, sample: Sample, document: Document, method: str, budget: float | None
    ) -> Iterator[dict[str, Any]]:
        """One session (prepared once) answering the sample's questions: one row each."""
        extra: dict[str, Any] = {}
        if self.config.span_tokens is not None:
            extra["store_settings"] = StoreSettings().with_span_tokens(*self.config.span_tokens)
        if self.config.neighbours is not None:
            extra["neighbours"] = self.config.neighbours
        if self.config.near is not None:
            extra["near"] = self.config.near
        settings = MethodSettings(
            memory_ratio=budget,
            measure_recall=self.config.recall,
            kv_bits=self.config.kv_bits,
            extra=extra,
        )
        if method == "sekv-trained":
            settings = replace(settings, router=self.config.trained_router)
        session = Session(self.loaded, document, method, settings)
        for q in sample.questions:
            a = session.ask(q.question, self.config.max_new_tokens)
            mem, t = a.memory, a.timings
            full = mem["full_kv_bytes_fp16"]
            yield {
                "sample": sample.name,
                "task": sample.task,
                "method": method,
                "budget": budget,
                "length": session.doc_tokens,
                "target_length": sample.length,
                "depth": sample.depth,
                "seed": sample.seed,
                "question": q.question,
                "expected": list(q.answers),
                "mode": q.mode,
                "score": round(score(a.answer, q.answers, q.mode), 4),
                "correct": is_correct(a.answer, q.answers, q.mode),
                "answer": a.answer[:ANSWER_CHARS],
                "resident_ratio": resident_share(mem),
                "store_ratio": round(mem["offloaded_bytes"] / full, 5),
                "ingest_s": round(session.prepare_s, 4),
                "cache_hit": bool(a.store.get("cache_hit")),
                "first_token_s": round(t["first_token_s"] - t["prepare_s"], 4),
                "decode_tps": t["decode_tokens_per_s"],
                "tokens_generated": a.tokens_generated,
                "routing": a.routing,
            }

    def status(self, sample: Sample) -> str:
        """One line: the sample and each method's score on it, with its resident ratio."""
        parts = []
        for (method, budget), rows in group(
            r for r in self.rows if r["sample"] == sample.name
        ).items():
            parts.append(
                f"{config_label(method, budget)} {mean(r['score'] for r in rows):.2f} "
                f"({mean(r['resident_ratio'] for r in rows):.1%})"
            )
        failed = [e for e in self.errors if e["sample"] == sample.name]
        parts += [f"{config_label(e['method'], e['budget'])} failed: {e['error']}" for e in failed]
        return f"{sample.name}: " + ", ".join(parts)

    def finish(self) -> dict[str, Any]:
        """Write summary.json, results.md and the plots; return the summary."""
        config = asdict(self.config)
        config["qa_docs"] = [str(p) for p in config["qa_docs"] or []] or None
        return write_report(self.out, self.loaded.model_id, config, self.rows, self.errors)


def write_report(
    out: Path, model: str, config: dict[str, Any], rows: list[dict], errors: list[dict]
) -> dict[str, Any]:
    """summary.json, results.md and the plots of ``rows`` into ``out``; returns the summary."""
    files = {"results": "results.jsonl", "summary": "summary.json", "table": "results.md"}
    if plots.accuracy_vs_memory(by_budget(rows), out / "accuracy_vs_memory.png"):
        files["accuracy_vs_memory"] = "accuracy_vs_memory.png"
    if plots.needle_heatmap(rows, out / "needle_heatmap.png"):
        files["needle_heatmap"] = "needle_heatmap.png"
    summary = {
        "model": model,
        "config": config,
        "rows": len(rows),
        "cells": cells(rows),
        "by_budget": by_budget(rows),
        "goal": goal(rows),
        "errors": errors,
        "files": files,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "results.md").write_text(markdown(summary))
    return summary


def merge_runs(runs: list[Path], out: Path) -> dict[str, Any]:
    """One report from several runs' directories (e.g. methods run at different times):
    their results.jsonl rows are concatenated into ``out``."""
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
        rows += [json.loads(line) for line in lines if line.strip()]
        errors += summary.get("errors", [])
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
        "budgets": values("budget"),
        "seeds": values("seed"),
        "merged_from": [str(r) for r in runs],
    }
    return write_report(out, model, config, rows, errors)


def config_label(method: str, budget: float | None) -> str:
    return method if budget is None else f"{method}@{budget:g}"


def mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(sum(vals) / len(vals), 4) if vals else None


def group(rows: Iterable[dict], *keys: str) -> dict[tuple, list[dict]]:
    """Rows grouped by (method, budget, *keys), in first-seen order."""
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        out[(r["method"], r["budget"], *(r[k] for k in keys))].append(r)
    return out


def figures(rows: list[dict]) -> dict[str, Any]:
    """Accuracy (mean score, RULER's figure), exact (share fully correct), ratios, timings."""
    built = [r for r in rows if not r["cache_hit"]]
    return {
        "n": len(rows),
        "accuracy": mean(r["score"] for r in rows),
        "exact": mean(float(r["correct"]) for r in rows),
        "resident_ratio": mean(r["resident_ratio"] for r in rows),
        "store_ratio": mean(r["store_ratio"] for r in rows),
        "ingest_s": mean(r["ingest_s"] for r in built),
        "first_token_s": mean(r["first_token_s"] for r in rows),
        "decode_tps": mean(r["decode_tps"] for r in rows),
        # span routing (SeKV methods; None elsewhere)
        "zoom_rate": mean(r.get("routing", {}).get("zoom_rate") for r in rows),
        "mean_rank_k": mean((r.get("routing", {}).get("mean_rank") or {}).get("k") for r in rows),
        "recall_vs_oracle": mean(r.get("routing", {}).get("recall_vs_oracle") for r in rows),
        "mass_captured": mean(r.get("routing", {}).get("mass_captured") for r in rows),
        "oracle_mass_captured": mean(
            r.get("routing", {}).get("oracle_mass_captured") for r in rows
        ),
    }


def cells(rows: list[dict]) -> list[dict]:
    """Figures per method × budget × task × target length."""
    return [
        {"method": m, "budget": b, "task": t, "length": n} | figures(rs)
        for (m, b, t, n), rs in group(rows, "task", "target_length").items()
    ]


def by_budget(rows: list[dict]) -> list[dict]:
    """Figures per method × budget over all tasks (what the accuracy-vs-memory plot draws)."""
    return [{"method": m, "budget": b} | figures(rs) for (m, b), rs in group(rows).items()]


def goal(rows: list[dict]) -> dict[str, Any]:
    """The stated goal, checked per task and budget. Each SeKV variant (``sekv*``) must be at
    least as accurate as every budgeted baseline at the same budget *without holding more
    resident memory* (measured, ``MEMORY_SLACK`` allowed), and as accurate as full KV wherever
    its measured resident ratio is at most ``GOAL_RATIO``. Lists every comparison and misses."""
    acc = {k: figures(rs) for k, rs in group(rows, "task").items()}
    methods = {m for m, _, _ in acc}
    sekvs = sorted(m for m in methods if m.startswith("sekv"))
    others = sorted(m for m in methods if m not in sekvs and m != "full")
    checks = []
    for (method, budget, task), f in acc.items():
        if method not in sekvs or budget is None:
            continue
        rivals = [(o, budget) for o in others]
        if f["resident_ratio"] <= GOAL_RATIO:
            rivals.append(("full", None))
        for rival in rivals:
            if (g := acc.get((*rival, task))) is None:
                continue
            why = []
            if f["accuracy"] < g["accuracy"]:
                why.append("lower accuracy")
            if rival[0] != "full" and f["resident_ratio"] > g["resident_ratio"] * MEMORY_SLACK:
                why.append("more resident memory")
            checks.append(
                {
                    "task": task,
                    "sekv": config_label(method, budget),
                    "rival": config_label(*rival),
                    "sekv_accuracy": f["accuracy"],
                    "rival_accuracy": g["accuracy"],
                    "sekv_resident": f["resident_ratio"],
                    "rival_resident": g["resident_ratio"],
                    "holds": not why,
                    "why": ", ".join(why),
                }
            )
    notes = [] if sekvs else ["no SeKV method in the run"]
    notes += [] if others else ["no budgeted baseline in the run"]
    for m in sekvs:
        lowest = min(
            (f["resident_ratio"] for (k, b, _), f in acc.items() if k == m and b), default=1
        )
        if lowest > GOAL_RATIO:
            notes.append(
                f"{m} never got to <= {GOAL_RATIO:.0%} resident (lowest measured {lowest:.1%}), "
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
    """The results as Markdown: per-cell table, per-budget table, the goal and its misses."""
    c = summary["config"]
    parts = [
        f"# sekv bench: {summary['model']}",
        f"Methods {', '.join(c['methods'])}; tasks {', '.join(c['tasks'])}; lengths "
        f"{', '.join(map(str, c['lengths']))}; depths {', '.join(map(str, c['depths']))}; "
        f"budgets {', '.join(map(str, c['budgets']))}; seeds {', '.join(map(str, c['seeds']))}; "
        f"{summary['rows']} answers. Accuracy: mean string-match score (RULER; partial credit "
        "when several strings are expected); exact: share fully right. Resident / store: bytes "
        "as measured, over the fp16 full KV cache. Ingest s: prepare time of sessions that built "
        "their memory (store cache misses).",
        "## Per method, task and length",
        _table(
            ["method", "budget", "task", "length", "n", "accuracy", "exact", "resident", "store"]
            + ["ingest s", "first token s", "decode tok/s"],
            [
                [x["method"], _num(x["budget"]), x["task"], str(x["length"]), str(x["n"])]
                + [_num(x["accuracy"]), _num(x["exact"]), _pct(x["resident_ratio"])]
                + [_pct(x["store_ratio"]), _num(x["ingest_s"]), _num(x["first_token_s"], 3)]
                + [_num(x["decode_tps"], 1)]
                for x in summary["cells"]
            ],
        ),
        "## Per method and budget (all tasks)",
        _table(
            ["method", "budget", "n", "accuracy", "exact", "resident", "store"]
            + ["zoom rate", "key rank", "recall vs oracle", "mass held (oracle's)"],
            [
                [x["method"], _num(x["budget"]), str(x["n"]), _num(x["accuracy"])]
                + [_num(x["exact"]), _pct(x["resident_ratio"]), _pct(x["store_ratio"])]
                + [_pct(x["zoom_rate"]), _num(x["mean_rank_k"], 1)]
                + [_num(x["recall_vs_oracle"])]
                + [_held(x)]
                for x in summary["by_budget"]
            ],
        ),
        "## Goal",
        f"SeKV ≥ every baseline's accuracy at equal resident memory (same budget; measured "
        f"ratios shown), and equal to full KV at ≤ {GOAL_RATIO:.0%} resident. "
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
            f"- {e['sample']} {config_label(e['method'], e['budget'])}: {e['error']}"
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
            f"comparisons (per task and budget), listed below.{notes}"
        )
    verdict = "Holds" if g["holds"] else "Not fully shown"
    return f"{verdict}: SeKV is ahead or level in all {g['checked']} comparisons.{notes}"
