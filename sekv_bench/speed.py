"""Speed: SeKV vs full KV, measured side by side in one run.

Per document size (a generated haystack) both methods answer the same question through the
engine, decoding the same teacher-forced tokens (:class:`sekv_core.decode.Forcing`: neither stops
early). Reported per method: the preparation (full KV's prefill; SeKV's store build in an empty
``$SEKV_HOME``, twice each, alternately; then a second session loading that store from disk),
time to first token of a fresh session (preparation + first token) and of a question on a
prepared session, and decode speed (median over ``repeats`` answers, taken alternately full,
sekv, full, … after one warm-up answer each). Optionally the same while a CPU-heavy neighbour
runs (decode speed is what a shared machine changes most), and `sekv` run as child processes
(:mod:`.speed_env`): the whole-process wall time of a question and the peak RSS of the store
build vs full KV's prefill.
"""

from __future__ import annotations

import gc
import json
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from sekv_core.decode import Forcing
from sekv_core.documents import Document, load_document
from sekv_core.engine import Answer, Session
from sekv_core.models import LoadedModel

from .haystack import NEEDLES, haystack
from .rows import markdown_table, resident_share
from .speed_env import cpu_neighbour, fresh_home, machine, process_runs

NEEDLE = NEEDLES[0]
NEUTRAL = (
    "The notes were read aloud in the hall, one page after another, and the clerk wrote down "
    "each ordinary item in the book before the meeting closed for the evening."
)
BUILD_PAIRS = 2  # prefill, build, prefill, build: the build ratio from pairs side by side
WARM_UP_TOKENS = 200  # a small haystack both methods answer once before anything is timed


def session(loaded: LoadedModel, document: Document, method: str) -> Session:
    """A session of ``method`` with the settings `sekv ask` gives it by default."""
    return Session(loaded, document, method)


@dataclass
class SpeedConfig:
    """What one run measures: haystack ``sizes`` (tokens), ``tokens`` decoded per answer,
    ``repeats`` timed answers per method, the child-process runs (``processes``, with the
    ``model`` name they load and their ``threads``) and a second, ``contention`` pass."""

    sizes: list[int]
    tokens: int = 48
    repeats: int = 3
    processes: bool = True
    contention: bool = False
    model: str | None = None
    threads: int = 1


def forced_tokens(tokenizer, count: int) -> list[int]:
    """``count`` token ids of a neutral sentence (repeated as needed): the answer both methods
    are fed, so each decodes exactly ``count`` tokens."""
    ids = tokenizer(" " + NEUTRAL, add_special_tokens=False)["input_ids"]
    return (ids * (count // len(ids) + 1))[:count]


def forced_answer(session: Session, ids: list[int]) -> Answer:
    """The needle question answered with ``ids`` fed as the answer (teacher forcing)."""
    return session.ask(NEEDLE.question, len(ids), forcing=Forcing(ids))


def write_haystack(tokenizer, tokens: int, folder: Path) -> Document:
    """A generated haystack of about ``tokens`` tokens (needle at mid depth), loaded."""
    path = folder / f"haystack-{tokens}.txt"
    path.write_text(haystack(tokenizer, tokens, 0.5, NEEDLE, seed=tokens))
    return load_document(path)


def repeated(answers: list[Answer]) -> dict[str, Any]:
    """Medians over the timed answers of one prepared session."""
    speeds = [a.timings["decode_tokens_per_s"] for a in answers]
    firsts = [a.timings["first_token_s"] - a.timings["prepare_s"] for a in answers]
    return {
        "decode_tokens_per_s": round(statistics.median(speeds), 2),
        "decode_runs": speeds,
        "first_token_prepared_s": round(statistics.median(firsts), 4),
        "tokens_decoded": answers[0].tokens_generated,
    }


def preparations(
    loaded: LoadedModel, document: Document, ids: list[int], folder: Path
) -> tuple[Session, Answer, dict[str, Any], dict[str, Any]]:
    """Full KV's prefill and SeKV's store build, alternately, ``BUILD_PAIRS`` times (each build
    over the prefill just before it: the machine's drift cancels). The first full session is
    kept with its fresh answer; the first store stays in the pass's home, the others are built
    in a home of their own. Returns (full, its answer, full's figures, SeKV's figures)."""
    full = session(loaded, document, "full")
    full_fresh = forced_answer(full, ids)  # warm-up: prefill + first token
    prefills, builds, sekv = [full.prepare_s], [], {}
    for pair in range(BUILD_PAIRS):
        if pair:
            prefills.append(session(loaded, document, "full").prepare_s)  # dropped at once
        with fresh_home(folder) if pair else nullcontext():  # an empty store home each time
            built = session(loaded, document, "sekv")
            builds.append(built.prepare_s)
            if not pair:
                sekv["build_cache_hit"] = built.method.store_info()["cache_hit"]
                sekv["build_first_token_s"] = forced_answer(built, ids).timings["first_token_s"]
            del built  # one SeKV session in memory while timing
    sekv |= {"build_s": round(statistics.median(builds), 4), "build_runs": builds}
    figures = {"prefill_s": round(statistics.median(prefills), 4), "prefill_runs": prefills}
    return full, full_fresh, figures, sekv


def measure(
    loaded: LoadedModel, document: Document, ids: list[int], repeats: int, folder: Path
) -> dict:
    """Both methods on ``document``: preparations, fresh first tokens, then the timed answers
    alternately (the store home must not hold this document's store yet)."""
    full, full_fresh, prefilled, build = preparations(loaded, document, ids, folder)
    cached = session(loaded, document, "sekv")  # the store loaded from disk
    cached_fresh = forced_answer(cached, ids)
    runs: dict[str, list[Answer]] = {"full": [], "sekv": []}
    for _ in range(repeats):
        runs["full"].append(forced_answer(full, ids))
        runs["sekv"].append(forced_answer(cached, ids))
    # each SeKV answer over the full-KV answer just before it: the machine's drift cancels
    pairs = [
        ratio(s.timings["decode_tokens_per_s"], f.timings["decode_tokens_per_s"])
        for f, s in zip(runs["full"], runs["sekv"], strict=True)
    ]
    row = {
        "tokens": full.doc_tokens,
        "context_tokens": len(full.context),
        "full": {
            **prefilled,
            "first_token_fresh_s": full_fresh.timings["first_token_s"],
            **repeated(runs["full"]),
        },
        "sekv": {
            **build,
            "load_s": round(cached.prepare_s, 4),
            "load_cache_hit": cached.method.store_info()["cache_hit"],
            "first_token_fresh_s": cached_fresh.timings["first_token_s"],
            "resident_share": resident_share(cached_fresh.memory, 4),
            "router": cached.method.routing()["router"],
            **repeated(runs["sekv"]),
        },
        "decode_pair_ratios": pairs,
        "build_pair_ratios": [
            ratio(b, f) for f, b in zip(prefilled["prefill_runs"], build["build_runs"], strict=True)
        ],
    }
    del full, cached, full_fresh, cached_fresh, runs  # each method measured alone next
    row["device_peak_bytes"] = device_peaks(loaded, document, ids)
    return row


def device_peaks(loaded: LoadedModel, document: Document, ids: list[int]) -> dict | None:
    """On a CUDA device: the most device memory above the weights that a fresh session's first
    answer takes, per method, each alone (full KV: its prefill and cache; SeKV: its store
    loaded, the resident tier and the zoom). None elsewhere (the child processes' peak RSS
    measures a CPU)."""
    if loaded.device.type != "cuda":
        return None
    peaks = {}
    for method in ("full", "sekv"):  # the store home already holds SeKV's store
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(loaded.device)
        torch.cuda.reset_peak_memory_stats(loaded.device)
        forced_answer(session(loaded, document, method), ids)  # dropped before the next
        peaks[method] = torch.cuda.max_memory_allocated(loaded.device) - base
    return peaks


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def ratios(row: dict[str, Any]) -> dict[str, float | None]:
    """SeKV over full KV (below 1: SeKV takes less; for decode, above 1: SeKV is faster)."""
    f, s, p = row["full"], row["sekv"], row.get("processes")
    pairs, peaks = row.get("decode_pair_ratios") or [], row.get("device_peak_bytes")
    builds = [b for b in row.get("build_pair_ratios") or [] if b is not None]
    out = {
        "decode": ratio(s["decode_tokens_per_s"], f["decode_tokens_per_s"]),
        "decode_pair_min": min(pairs) if pairs else None,
        "decode_pair_max": max(pairs) if pairs else None,
        "device_peak": ratio(peaks["sekv"], peaks["full"]) if peaks else None,
        "first_token_fresh": ratio(s["first_token_fresh_s"], f["first_token_fresh_s"]),
        "first_token_prepared": ratio(s["first_token_prepared_s"], f["first_token_prepared_s"]),
        "build_over_prefill": (
            round(statistics.median(builds), 4) if builds else ratio(s["build_s"], f["prefill_s"])
        ),
        "build_pair_min": min(builds) if builds else None,
        "build_pair_max": max(builds) if builds else None,
        "load_over_prefill": ratio(s["load_s"], f["prefill_s"]),
        "process_wall": None,
        "process_first_token": None,
        "build_rss_over_prefill_rss": None,
    }
    if p is not None:
        out["process_wall"] = ratio(p["ask_sekv"]["wall_s"], p["ask_full"]["wall_s"])
        out["process_first_token"] = ratio(
            p["ask_sekv"]["first_token_after_start_s"], p["ask_full"]["first_token_after_start_s"]
        )
        out["build_rss_over_prefill_rss"] = ratio(
            p["build"]["peak_rss_bytes"], p["ask_full"]["peak_rss_bytes"]
        )
    return out


@contextmanager
def condition(name: str, folder: Path) -> Iterator[None]:
    """An empty store home for the pass, and a CPU-heavy neighbour when ``contended``."""
    with cpu_neighbour() if name == "contended" else nullcontext(), fresh_home(folder):
        yield


def warm_up(loaded: LoadedModel, folder: Path, ids: list[int]) -> None:
    """One untimed answer per method on a small haystack (first-call costs land here)."""
    document = write_haystack(loaded.tokenizer, WARM_UP_TOKENS, folder)
    for method in ("full", "sekv"):
        forced_answer(session(loaded, document, method), ids)


def run_pass(
    loaded: LoadedModel, config: SpeedConfig, name: str, folder: Path, on_row: Callable | None
) -> list[dict[str, Any]]:
    """Every size measured under condition ``name`` (idle or contended); the idle pass also
    runs the child processes when ``config.processes``."""
    ids = forced_tokens(loaded.tokenizer, config.tokens)
    rows = []
    with condition(name, folder):
        warm_up(loaded, folder, ids)
        for size in config.sizes:
            document = write_haystack(loaded.tokenizer, size, folder)
            row = {"target_tokens": size, "condition": name}
            row.update(measure(loaded, document, ids, config.repeats, folder))
            if config.processes and name == "idle":
                row["processes"] = process_runs(
                    document.path, NEEDLE.question, config.tokens, config.model, config.threads
                )
            row["ratios"] = ratios(row)
            rows.append(row)
            if on_row:
                on_row(row)
    return rows


def bench_speed(
    loaded: LoadedModel,
    config: SpeedConfig,
    out: Path,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Measure every size idle (and contended when asked); write ``out/results.json`` and
    ``out/results.md``; return the results."""
    out.mkdir(parents=True, exist_ok=True)
    names = ["idle", "contended"] if config.contention else ["idle"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="sekv-speed-") as tmp:
        for name in names:
            rows += run_pass(loaded, config, name, Path(tmp), on_row)
    result = {
        "model": loaded.model_id,
        "machine": machine(str(loaded.device)),
        "config": asdict(config),
        "question": NEEDLE.question,
        "rows": rows,
        "summary": summary(rows),
        "files": {"results": "results.json", "table": "results.md"},
    }
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "results.md").write_text(markdown(result))
    return result


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per size: the ratios, with the contended decode ratio beside the idle one."""
    idle = [r for r in rows if r["condition"] == "idle"]
    contended = {r["target_tokens"]: r for r in rows if r["condition"] == "contended"}
    out = []
    for r in idle:
        other = contended.get(r["target_tokens"])
        out.append(
            {
                "tokens": r["tokens"],
                **r["ratios"],
                "decode_contended": other["ratios"]["decode"] if other else None,
            }
        )
    return out


def progress_line(row: dict[str, Any]) -> str:
    """One line per measured size (progress on stderr)."""
    q = row["ratios"]
    return (
        f"{row['tokens']:,} tokens ({row['condition']}): decode sekv/full {times(q['decode'])}, "
        f"first token {times(q['first_token_fresh'])}, build/prefill "
        f"{times(q['build_over_prefill'])}"
    )


def seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def times(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def spread(q: dict[str, Any], what: str = "decode") -> str:
    """The range of the alternating pairs' ratios of ``what`` (decode, build), where there are
    several."""
    low, high = q.get(f"{what}_pair_min"), q.get(f"{what}_pair_max")
    return "" if low is None or low == high else f" ({low:.2f}–{high:.2f})"


def table_rows(result: dict[str, Any]) -> list[dict[str, str]]:
    """One display row per measured size and condition (the Markdown and terminal table)."""
    shown = []
    for r in result["rows"]:
        f, s, q = r["full"], r["sekv"], r["ratios"]
        shown.append(
            {
                "tokens": f"{r['tokens']:,}",
                "run": r["condition"],
                "decode tok/s full / sekv": f"{f['decode_tokens_per_s']:.1f} / "
                f"{s['decode_tokens_per_s']:.1f}",
                "decode ×": times(q["decode"]) + spread(q),
                "1st token s full / sekv": f"{seconds(f['first_token_fresh_s'])} / "
                f"{seconds(s['first_token_fresh_s'])}",
                "1st token ×": times(q["first_token_fresh"]),
                "prefill / build / load s": f"{seconds(f['prefill_s'])} / "
                f"{seconds(s['build_s'])} / {seconds(s['load_s'])}",
                "build ×": times(q["build_over_prefill"]) + spread(q, "build"),
                "ask 1st byte s full / sekv": process_first_tokens(r.get("processes")),
                "warm: full / sekv": warm_first_tokens(r.get("processes")),
                "ask wall ×": times(q["process_wall"]),
                "peak RSS ×": times(q["build_rss_over_prefill_rss"]),
            }
        )
        if r.get("device_peak_bytes"):
            peaks = r["device_peak_bytes"]
            shown[-1]["device memory MiB full / sekv"] = (
                f"{peaks['full'] / 2**20:.0f} / {peaks['sekv'] / 2**20:.0f} "
                f"({times(q['device_peak'])})"
            )
    return shown


def process_first_tokens(runs: dict[str, Any] | None) -> str:
    """`sekv ask`'s first byte on stdout after the process started, full KV / SeKV (a stored
    document): "–" without the child processes."""
    if runs is None:
        return "–"
    full, sekv = (runs[k]["first_byte_s"] for k in ("ask_full", "ask_sekv"))
    return f"{seconds(full)} / {seconds(sekv)}"


def warm_first_tokens(runs: dict[str, Any] | None) -> str:
    """The same with a warm process (`sekv warm`) running the commands."""
    if runs is None or runs["ask_sekv"].get("first_byte_warm_s") is None:
        return "–"
    full, sekv = (runs[k]["first_byte_warm_s"] for k in ("ask_full", "ask_sekv"))
    return f"{seconds(full)} / {seconds(sekv)}"


def routers(result: dict[str, Any]) -> str:
    """The router(s) SeKV's answers used (``trained`` where the model ships one)."""
    return " / ".join(sorted({r["sekv"].get("router", "training-free") for r in result["rows"]}))


def markdown(result: dict[str, Any]) -> str:
    """results.md: the table, the machine and what each column means."""
    rows = table_rows(result)
    m, c = result["machine"], result["config"]
    lines = [
        "# SeKV vs full KV: speed",
        "",
        f"Model {result['model']} on {m['cpu']} ({m['cores']} cores, {m['torch_threads']} torch "
        f"threads, torch {m['torch']}, {m['device']}); {c['tokens']} tokens decoded per answer "
        f"(teacher-forced, both methods), median of {c['repeats']} answers each. SeKV "
        f"answers as `sekv ask` does: the {routers(result)} router.",
        "",
        *markdown_table(rows),
        "",
        "×: SeKV over full KV (decode: above 1, SeKV is faster; the others: below 1, SeKV "
        "takes less); the ranges: each SeKV answer (build) over the full-KV answer (prefill) just "
        "before it. "
        "Device memory (CUDA): the most a fresh session's first answer allocates above the "
        "weights, each method alone. 1st token: a fresh session's first answer (full KV: "
        "prefill + first token; SeKV: the store loaded from disk + first token). Build: "
        f"SeKV's first session on the document (an empty store home) vs full KV's prefill, "
        f"median of {BUILD_PAIRS} each, alternately. "
        "Ask 1st byte: `sekv ask`'s first byte on stdout after the process was started, as "
        "at a shell (interpreter start-up, imports, the model and, for SeKV, its stored "
        "document loaded, the first token); warm: the same with `sekv warm` running (the "
        "imports done before the command starts). "
        "Ask wall: `sekv ask` as a whole process on a cached store vs `sekv ask --method "
        "full`. Peak RSS: `sekv ingest` vs `sekv ask --method full` (its prefill).",
        "",
    ]
    return "\n".join(lines)
