"""Fidelity to full KV: how closely each method's answers follow full KV's, token by token.

Accuracy on a few dozen questions moves by a whole question at a time; fidelity sees every token.
For each question, full KV answers greedily (the reference, up to ``answer_tokens`` tokens); each
method then reads the same answer under teacher forcing (:func:`sekv_core.decode.forced`) and at
every step we compare its next-token distribution with full KV's:

- **top-1 agreement**: share of answer tokens the method would have chosen too;
- **KL(full ‖ method)** in nats per answer token;
- **identical answers**: share of questions where every token agrees (the method, decoding freely,
  would have written full KV's answer).

Samples are the suite's (:mod:`sekv_core.bench.suite`): generated tasks and the sample documents'
questions. Every row reports the resident memory as measured (share of fp16 full KV).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..attention import ZoomPolicy
from ..decode import forced
from ..documents import load_document
from ..engine import Session
from ..errors import SekvError
from ..methods import MethodSettings
from ..models import LoadedModel
from ..store import StoreSettings
from . import resident_share
from .suite import SuiteConfig, budgeted, build_samples, config_label, group

DEFAULT_ANSWER_TOKENS = 24
EVERY_SPAN = 1 << 30  # a zoom budget (tokens per layer and KV head) no document reaches


def run_fidelity(
    loaded: LoadedModel,
    config: SuiteConfig,
    out: Path,
    answer_tokens: int = DEFAULT_ANSWER_TOKENS,
    settings: MethodSettings | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    every_span: bool = False,
) -> dict[str, Any]:
    """Every (method, budget) against full KV on every sample question; writes ``out``'s
    results.jsonl, summary.json and fidelity.md and returns the summary. ``sekv-trained`` routes
    with ``config.trained_router`` (auto: the router trained for the model), ``sekv``
    training-free. ``every_span``: no memory target, SeKV zooms every span (the ceiling its
    store sets: what reconstruction alone loses); other methods keep the whole cache."""
    if "full" in config.methods:
        raise SekvError(
            "full KV is the reference of the fidelity benchmark; drop it from --methods"
        )
    config.check(loaded.spec.window)
    base = settings or MethodSettings()
    if every_span:
        base = replace(base, budget=EVERY_SPAN)
    out = Path(out)
    (out / "samples").mkdir(parents=True, exist_ok=True)
    configs = [
        (method, budget)
        for method in config.methods
        for budget in (config.budgets if budgeted(method) and not every_span else [None])
    ]
    rows: list[dict[str, Any]] = []
    with (out / "results.jsonl").open("w") as sink:
        for sample in build_samples(config, loaded.tokenizer):
            path = sample.source
            if path is None:
                path = out / "samples" / f"{sample.name}.txt"
                path.write_text(sample.text)
            document = load_document(path)
            reference = Session(loaded, document, "full", replace(base, memory_ratio=None))
            refs = []
            for q in sample.questions:
                with forced() as record:
                    reference.ask(q.question, answer_tokens)
                logprobs = torch.stack(record.logprobs)  # (n, V) incl. a final stop token
                refs.append((q.question, logprobs.argmax(-1).tolist(), logprobs))
            for method, budget in configs:
                chosen = replace(base, memory_ratio=budget)
                if method == "sekv-trained":
                    chosen = replace(chosen, router=config.trained_router)
                session = Session(loaded, document, method, chosen)
                for question, ids, ref in refs:
                    with forced(ids) as record:
                        answer = session.ask(question, len(ids))
                    row = compare(ref, torch.stack(record.logprobs), ids)
                    mem = answer.memory
                    row = {
                        "sample": sample.name,
                        "task": sample.task,
                        "length": session.doc_tokens,
                        "method": method,
                        "budget": budget,
                        "question": question,
                        **row,
                        "resident_ratio": resident_share(mem),
                        "routing": answer.routing,
                    }
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                    rows.append(row)
                    if on_row:
                        on_row(row)
    summary = {
        "answer_tokens": answer_tokens,
        "every_span": every_span,
        "kv_bits": base.kv_bits,
        "store": (base.extra.get("store_settings") or StoreSettings()).to_dict(),
        "neighbours": base.extra.get("neighbours", ZoomPolicy.neighbours),
        "near": base.extra.get("near"),  # None: the method's default (SeKV.near_share)
        "trained_router": config.trained_router if "sekv-trained" in config.methods else None,
        "configs": summarize(rows),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "fidelity.md").write_text(markdown(summary))
    return summary


def compare(reference: torch.Tensor, got: torch.Tensor, ids: list[int]) -> dict[str, Any]:
    """Per-answer figures of log-probs ``got`` (n, V) against ``reference`` (n, V) along ``ids``."""
    target = torch.tensor(ids)
    agree = got.argmax(-1) == target
    kl = (reference.exp() * (reference - got)).sum(-1).clamp(min=0)  # (n,)
    misses = torch.nonzero(~agree)
    return {
        "tokens": len(ids),
        "agree": int(agree.sum()),
        "kl_sum": round(float(kl.sum()), 5),
        "first_miss": int(misses[0]) if len(misses) else None,
    }


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (method, budget): agreement, KL per token, identical answers, resident."""
    out = []
    for (method, budget), part in group(rows).items():
        tokens = sum(r["tokens"] for r in part)
        out.append(
            {
                "method": method,
                "budget": budget,
                "label": config_label(method, budget),
                "questions": len(part),
                "tokens": tokens,
                "top1_agreement": round(sum(r["agree"] for r in part) / tokens, 4),
                "kl_per_token": round(sum(r["kl_sum"] for r in part) / tokens, 6),
                "identical_answers": round(
                    sum(r["first_miss"] is None for r in part) / len(part), 4
                ),
                "resident_ratio": round(sum(r["resident_ratio"] for r in part) / len(part), 4),
            }
        )
    return out


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        f"Fidelity to full KV along full KV's own answers (up to {summary['answer_tokens']} "
        "tokens, teacher-forced).",
        "",
        "| method | budget | questions | top-1 agreement | KL nats/token | identical answers "
        "| resident |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in summary["configs"]:
        budget = "–" if c["budget"] is None else f"{c['budget']:.2f}"
        lines.append(
            f"| {c['method']} | {budget} | {c['questions']} | {c['top1_agreement']:.3f} "
            f"| {c['kl_per_token']:.3f} | {c['identical_answers']:.2f} "
            f"| {c['resident_ratio']:.1%} |"
        )
    return "\n".join(lines) + "\n"
