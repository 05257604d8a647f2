"""The training corpus: documents generated in code, with planted facts and questions on them.

Nothing is downloaded and nothing is copied: sentences are assembled from parts written in
:mod:`~sekv_core.train.prose` (topical filler) and :mod:`~sekv_core.train.reports` (sectioned
reports). The generators are deliberately different from the benchmark haystacks (other topics,
other sentence shapes, other fact forms), so that benchmark figures are not measured on the
training distribution. Deterministic for a seed.
"""

from __future__ import annotations

import random

from .facts import TrainDoc
from .prose import make_doc
from .reports import make_report


def make_corpus(
    tokenizer, docs: int, seed: int = 0, lengths: tuple[int, int] = (500, 1500), facts: int = 4
) -> list[TrainDoc]:
    """``docs`` training documents of varied lengths, topics and shapes (deterministic for
    ``seed``): topical prose and sectioned reports in turn."""
    rng = random.Random(f"sekv-corpus-{seed}")
    out = []
    for i in range(docs):
        make = make_doc if i % 2 == 0 else make_report
        out.append(make(tokenizer, rng.randrange(*lengths), facts, seed * 1000 + i))
    return out
