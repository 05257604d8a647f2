"""Fidelity to full KV: how closely each method's answers follow full KV's, token by token.

Accuracy on a few dozen questions moves by a whole question at a time; fidelity sees every token.
For each question, full KV answers greedily (the reference, up to ``answer_tokens`` tokens); each
method then reads the same answer under teacher forcing (:class:`sekv_core.decode.Forcing`) and at
every step we compare its next-token distribution with full KV's:

- **top-1 agreement**: share of answer tokens the method would have chosen too;
- **KL(full ‖ method)** in nats per answer token;
- **identical answers**: share of questions where every token agrees (the method, decoding freely,
  would have written full KV's answer).

Samples are the suite's (:mod:`.suite`): generated tasks and the sample documents'
questions. Every row reports the resident memory as measured and the store on disk (shares of
the fp16 full KV), and SeKV's rows the time one reconstruction of every span takes per token
(:func:`reconstruct_time`): the store's size, its fidelity and its speed side by side.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from sekv_core.decode import Forcing
from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.errors import SekvError
from sekv_core.methods import PrefillSlot, SeKV
from sekv_core.models import LoadedModel

from .rows import config_label, group, resident_share
from .suite import SuiteConfig, build_samples, sample_path

DEFAULT_ANSWER_TOKENS = 24
EVERY_SPAN = 1 << 30  # a zoom budget (tokens per layer and KV head) no document reaches
NO_MARGIN = 1e9  # a span scoring this far below the best is still zoomed: none is left out


def run_fidelity(
    loaded: LoadedModel,
    config: SuiteConfig,
    out: Path,
    answer_tokens: int = DEFAULT_ANSWER_TOKENS,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    every_span: bool = False,
) -> dict[str, Any]:
    """Every (method, memory share) against full KV on every sample question; writes ``out``'s
    results.jsonl, summary.json and fidelity.md and returns the summary. Runs start from
    ``config``'s settings. ``every_span``: no memory target,
    SeKV zooms every span, however far below the best one the router scores it (the ceiling its
    store sets: what reconstruction alone loses; a trained router's gate still decides); other
    methods keep the whole cache."""
    if "full" in config.methods:
        raise SekvError(
            "full KV is the reference of the fidelity benchmark; drop it from --methods"
        )
    config.check(loaded.spec.window)
    base = config.method_settings()
    if every_span:
        base = replace(base, budget=EVERY_SPAN, margin=NO_MARGIN)
    out = Path(out)
    (out / "samples").mkdir(parents=True, exist_ok=True)
    runs = [(m, None) for m in config.methods] if every_span else config.runs()
    rows: list[dict[str, Any]] = []
    prefills = PrefillSlot()  # the eviction methods' full prefill, once per sample
    with (out / "results.jsonl").open("w") as sink:
        for sample in build_samples(config, loaded.tokenizer):
            document = load_document(sample_path(sample, out))
            reference = Session(loaded, document, "full", base)
            refs = []
            for q in sample.questions:
                record = Forcing()  # the reference's own answer, its log-probabilities recorded
                reference.ask(q.question, answer_tokens, forcing=record)
                logprobs = torch.stack(record.logprobs)  # (n, V) incl. a final stop token
                refs.append((q.question, logprobs.argmax(-1).tolist(), logprobs))
            for method, share in runs:
                settings = replace(base, memory_share=share)
                session = Session(loaded, document, method, settings, prefills=prefills)
                recon = None  # measured once the store is prepared (by the first answer)
                for question, ids, ref in refs:
                    record = Forcing(ids)
                    answer = session.ask(question, len(ids), forcing=record)
                    recon = reconstruct_time(session) if recon is None else recon
                    row = {
                        "sample": sample.name,
                        "task": sample.task,
                        "length": session.doc_tokens,
                        "method": method,
                        "memory_share": share,
                        "question": question,
                        **compare(ref, torch.stack(record.logprobs), ids),
                        "resident_share": resident_share(answer.memory),
                        "reconstruct_us": recon,
                        "store_share": store_share(answer.memory),
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
        "settings": {k: v for k, v in asdict(base).items() if k != "warn"},
        "configs": summarize(rows),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "fidelity.md").write_text(markdown(summary))
    return summary


def reconstruct_time(session: Session, repeats: int = 3) -> float | None:
    """Microseconds per (token, KV head) of one reconstruction of every span of every layer of
    a SeKV session's store (K and V; best of ``repeats``); None for other methods."""
    if not isinstance(session.method, SeKV) or session.method.spans.n_spans == 0:
        return None
    memory = session.method.spans
    H, N = memory.num_kv_heads, memory.n_spans
    spans, heads = torch.arange(N).repeat(H), torch.arange(H).repeat_interleave(N)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for layer in range(memory.num_layers):
            keys, values = memory.reconstruct(layer, spans, heads)
        if keys.is_cuda:
            torch.cuda.synchronize(keys.device)
        best = min(best, time.perf_counter() - t0)
    tokens = memory.num_layers * H * int(memory.lengths.sum())
    return round(1e6 * best / tokens, 4)


def _median(values: list[float | None]) -> float | None:
    kept = sorted(v for v in values if v is not None)
    return kept[len(kept) // 2] if kept else None


def store_share(memory: dict[str, Any]) -> float:
    """The method's store on disk over the document's fp16 full KV (0 without a store)."""
    return round(memory.get("store_bytes", 0) / memory["full_kv_bytes"], 5)


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
    """One line per (method, memory share): agreement, KL per token, identical answers,
    resident share, store on disk (share of the fp16 full KV; methods without one: 0)."""
    out = []
    for (method, share), part in group(rows).items():
        tokens = sum(r["tokens"] for r in part)
        out.append(
            {
                "method": method,
                "memory_share": share,
                "label": config_label(method, share),
                "questions": len(part),
                "tokens": tokens,
                "top1_agreement": round(sum(r["agree"] for r in part) / tokens, 4),
                "kl_per_token": round(sum(r["kl_sum"] for r in part) / tokens, 6),
                "identical_answers": round(
                    sum(r["first_miss"] is None for r in part) / len(part), 4
                ),
                "resident_share": round(sum(r["resident_share"] for r in part) / len(part), 4),
                "store_share": round(sum(r["store_share"] for r in part) / len(part), 4),
                "reconstruct_us": _median([r["reconstruct_us"] for r in part]),
            }
        )
    return out


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        f"Fidelity to full KV along full KV's own answers (up to {summary['answer_tokens']} "
        "tokens, teacher-forced).",
        "",
        "| method | memory | questions | top-1 agreement | KL nats/token | identical answers "
        "| resident | store on disk | reconstruct µs/token |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in summary["configs"]:
        share = "–" if c["memory_share"] is None else f"{c['memory_share']:.2f}"
        lines.append(
            f"| {c['method']} | {share} | {c['questions']} | {c['top1_agreement']:.3f} "
            f"| {c['kl_per_token']:.3f} | {c['identical_answers']:.2f} "
            f"| {c['resident_share']:.1%} | {c['store_share']:.1%} "
            f"| {'–' if c['reconstruct_us'] is None else c['reconstruct_us']} |"
        )
    return "\n".join(lines) + "\n"
