"""Training examples: generated documents made ready to train on, with their teacher signals.

Per document, the span store is built (or loaded) exactly as for answering and its full KV cache
is computed once; the span tokens' exact K/V are kept for the student. Per planted fact, one
example: the question, the answer to distil along (by default the full-KV model's own greedy
answer, as `sekv bench fidelity` reads) and the teacher's signals over them
(:mod:`~sekv_core.train.teacher`).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from ..config import StoreSettings
from ..documents import load_document
from ..ingest import open_or_build
from ..methods.full import prefill_cache
from ..models import LoadedModel
from ..prompt import encode_context, encode_question
from ..rope import Rope
from ..zoom.memory import SpanMemory
from .data import make_corpus
from .settings import TrainSettings
from .teacher import span_tokens, teacher_answer, teacher_pass

Log = Callable[[str], None]


@dataclass
class Example:
    """One question on one prepared document (teacher targets included)."""

    doc: int
    ids: list[int]  # question + answer tokens
    answer_len: int
    teacher_logp: torch.Tensor  # (Ta, V) log-probs of the answer positions
    mass: torch.Tensor  # (L, Hq, Tq, N) teacher span mass


@dataclass
class PreparedDoc:
    """A document's span memory and what the student reads of its full KV."""

    memory: SpanMemory
    context_len: int
    span_k: list[torch.Tensor]  # per layer (Hkv, S, D) exact post-RoPE keys of the span tokens
    span_v: list[torch.Tensor]
    span_id: torch.Tensor  # (S,) span of each span token


def prepare(
    loaded: LoadedModel, settings: TrainSettings, log: Log, store: StoreSettings | None = None
) -> tuple[list[PreparedDoc], list[Example], list[Example]]:
    """Generate the corpus; build stores (``store``: answering's default settings) and teacher
    signals. Returns docs, train examples, held-out examples."""
    tok = loaded.tokenizer
    template = loaded.template
    corpus = make_corpus(tok, settings.docs + settings.held_out, settings.seed, settings.doc_tokens)
    docs: list[PreparedDoc] = []
    examples: list[Example] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, train_doc in enumerate(corpus):
            t0 = time.perf_counter()
            path = Path(tmp) / f"train-{settings.seed}-{i}.txt"
            path.write_text(train_doc.text)
            document = load_document(path)
            context = encode_context(tok, template, document.text)
            span_store, _ = open_or_build(loaded, document, context, store or StoreSettings())
            memory = SpanMemory(span_store, Rope(loaded.model), loaded.device, loaded.dtype)
            cache = prefill_cache(loaded.model, context.ids, 512)
            doc = prepared_doc(memory, cache, len(context))
            docs.append(doc)
            for fact in train_doc.facts:
                q = encode_question(tok, template, fact.question)
                a = tok(" " + fact.answer, add_special_tokens=False)["input_ids"]
                if settings.answer_tokens:
                    a = teacher_answer(loaded, cache, len(context), q, settings.answer_tokens) or a
                logp, mass = teacher_pass(loaded, cache, memory, len(context), q + a, len(a))
                examples.append(Example(i, q + a, len(a), logp, mass))
            del cache
            log(
                f"prepared document {i + 1}/{len(corpus)} ({len(context)} tokens, "
                f"{memory.n_spans} spans) in {time.perf_counter() - t0:.1f} s"
            )
    held = [e for e in examples if e.doc >= settings.docs]
    return docs, [e for e in examples if e.doc < settings.docs], held


def prepared_doc(memory: SpanMemory, cache: DynamicCache, context_len: int) -> PreparedDoc:
    """The span tokens' K/V copied out of the document's full ``cache``, beside its memory."""
    tokens = span_tokens(memory)
    span_k = [layer.keys[0][:, tokens].detach().clone() for layer in cache.layers]
    span_v = [layer.values[0][:, tokens].detach().clone() for layer in cache.layers]
    return PreparedDoc(memory, context_len, span_k, span_v, memory.sketch_span.cpu())
