"""The benchmark suite: every method × resident-memory share on every task sample, side by side.

For each sample document and each (method, memory share) one :class:`~sekv_core.engine.Session`
is prepared and answers all the sample's questions; each answer is one row of ``results.jsonl``
(appended as it goes). Memory shares are resident-memory targets as a share of the document's
fp16 full KV cache (``MethodSettings.memory_share``); every row reports the share as *measured*
(``resident_share``), since a method may overshoot its target. Methods whose memory does not
follow a share (``full``, or ``follows_memory_share = False``) run once per document.
Generated documents are kept under ``out/samples/`` (``sekv ask`` can replay them).
:meth:`Suite.finish` writes the report (:mod:`.report`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sekv_core.config import MethodSettings, override
from sekv_core.documents import Document, load_document
from sekv_core.engine import Session
from sekv_core.errors import SekvError
from sekv_core.methods import METHODS, PrefillSlot
from sekv_core.models import LoadedModel

from .diagnostics import ask_probed, attach_probe
from .report import write_report
from .rows import config_label, group, mean, resident_share
from .score import is_correct, score
from .tasks import GENERATED, TASKS, Sample, make_sample, qa_samples

ANSWER_CHARS = 160  # answers are truncated in results.jsonl
QUESTION_ROOM = 128  # tokens a target length leaves for the prompt head and the question


@dataclass
class SuiteConfig:
    """What a suite (or fidelity) run covers.

    memory_shares : resident-memory targets, shares of the fp16 full KV cache (each method that
        follows one runs at each). settings : ``KEY=VALUE`` assignments applied to every run's
        :class:`~sekv_core.config.MethodSettings` (:func:`sekv_core.config.override`).
    """

    methods: list[str]
    tasks: list[str]
    lengths: list[int]
    depths: list[float]
    memory_shares: list[float]
    seeds: list[int]
    max_new_tokens: int = 48
    recall: bool = False  # SeKV methods are also held against the oracle router (diagnostics)
    qa_docs: list[Path] | None = None  # default: the sample documents
    settings: list[str] = field(default_factory=list)

    def method_settings(self) -> MethodSettings:
        """The settings every run starts from (its memory share is set per run)."""
        return override(MethodSettings(), self.settings)

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
        for s in self.memory_shares:
            if not 0 < s <= 1:
                raise SekvError(f"memory share {s} out of range; shares of full KV are in (0, 1]")
        if not self.memory_shares and any(follows_share(m) for m in self.methods):
            raise SekvError("no memory shares given for methods that follow one; e.g. 0.1,0.2")
        if not self.seeds:
            raise SekvError("no seeds given; e.g. 1")
        if any(a.partition("=")[0].strip() == "memory_share" for a in self.settings):
            raise SekvError(
                "memory_share is set per run from the memory shares (--memory); leave it out"
            )
        self.method_settings()  # names and values of the assignments

    def runs(self) -> list[tuple[str, float | None]]:
        """(method, memory share) pairs: methods that follow a share run at each."""
        return [
            (method, share)
            for method in self.methods
            for share in (self.memory_shares if follows_share(method) else [None])
        ]


def follows_share(method: str) -> bool:
    """Whether the method's resident memory follows ``memory_share`` (full KV's does not)."""
    return method != "full" and METHODS[method].follows_memory_share


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


def sample_path(sample: Sample, out: Path) -> Path:
    """The sample's file: its source, or the generated text written under ``out/samples``."""
    if sample.source is not None:
        return sample.source
    path = out / "samples" / f"{sample.name}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(sample.text)
    return path


class Suite:
    """Plans the runs (sample × method × memory share); :meth:`run` answers, :meth:`finish`
    reports."""

    def __init__(self, loaded: LoadedModel, config: SuiteConfig, out: Path) -> None:
        config.check(loaded.spec.window)
        self.loaded, self.config, self.out = loaded, config, Path(out)
        self.samples = build_samples(config, loaded.tokenizer)
        self.configs = config.runs()
        self.settings = config.method_settings()
        self.total = len(self.configs) * sum(len(s.questions) for s in self.samples)
        self.rows: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []
        self.prefills = PrefillSlot()  # the eviction methods' full prefill, once per sample

    def run(
        self,
        on_row: Callable[[dict[str, Any]], None] | None = None,
        on_sample: Callable[[str], None] | None = None,
    ) -> dict[str, Any]:
        """Answer every question for every (method, memory share); return the summary.

        Rows are appended to results.jsonl as they come. A run a method refuses (SekvError)
        is recorded in the summary's errors. ``on_row`` sees each row, ``on_sample`` a status
        line per sample done.
        """
        (self.out / "samples").mkdir(parents=True, exist_ok=True)
        with (self.out / "results.jsonl").open("w") as sink:  # a new run starts a new file
            for sample in self.samples:
                document = load_document(sample_path(sample, self.out))
                for method, share in self.configs:
                    try:
                        for row in self.answer(sample, document, method, share):
                            sink.write(json.dumps(row) + "\n")
                            sink.flush()
                            self.rows.append(row)
                            if on_row:
                                on_row(row)
                    except SekvError as exc:
                        self.errors.append(
                            {"sample": sample.name, "method": method, "memory_share": share}
                            | {"error": str(exc)}
                        )
                if on_sample:
                    on_sample(self.status(sample))
        return self.finish()

    def answer(
        self, sample: Sample, document: Document, method: str, share: float | None
    ) -> Iterator[dict[str, Any]]:
        """One session (prepared once) answering the sample's questions: one row each."""
        settings = replace(self.settings, memory_share=share)
        session = Session(self.loaded, document, method, settings, prefills=self.prefills)
        probe = attach_probe(session) if self.config.recall else None
        for q in sample.questions:
            a = ask_probed(session, q.question, self.config.max_new_tokens, probe)
            mem, t = a.memory, a.timings
            yield {
                "sample": sample.name,
                "task": sample.task,
                "method": method,
                "memory_share": share,
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
                "resident_share": resident_share(mem),
                "store_share": round(
                    mem.get("store_bytes", mem["offloaded_bytes"]) / mem["full_kv_bytes"], 5
                ),
                "ingest_s": round(session.prepare_s, 4),
                "cache_hit": bool(a.store.get("cache_hit")),
                "first_token_s": round(t["first_token_s"] - t["prepare_s"], 4),
                "decode_tps": t["decode_tokens_per_s"],
                "tokens_generated": a.tokens_generated,
                "routing": a.routing,
            }

    def status(self, sample: Sample) -> str:
        """One line: the sample and each method's score on it, with its resident share."""
        parts = []
        for (method, share), rows in group(
            r for r in self.rows if r["sample"] == sample.name
        ).items():
            parts.append(
                f"{config_label(method, share)} {mean(r['score'] for r in rows):.2f} "
                f"({mean(r['resident_share'] for r in rows):.1%})"
            )
        failed = [e for e in self.errors if e["sample"] == sample.name]
        parts += [
            f"{config_label(e['method'], e['memory_share'])} failed: {e['error']}" for e in failed
        ]
        return f"{sample.name}: " + ", ".join(parts)

    def finish(self) -> dict[str, Any]:
        """Write summary.json, results.md and the plots; return the summary."""
        config = asdict(self.config)
        config["qa_docs"] = [str(p) for p in config["qa_docs"] or []] or None
        return write_report(self.out, self.loaded.model_id, config, self.rows, self.errors)
