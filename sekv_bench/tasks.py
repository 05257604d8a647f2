"""Benchmark tasks in the manner of RULER, generated here (no hub, no copied text).

Every generated sample is a haystack of filler sentences (:mod:`.haystack`) with invented facts
planted at relative depths; its questions carry the expected answer strings and how they are
scored (``"all"``: every string must appear, ``"any"``: one suffices, see :mod:`.score`).

- ``needle``: one fact (an access code), asked back.
- ``multikey``: several facts of the same form under different keys; one key is asked.
- ``multivalue``: one key with several values stated at different depths; all must be returned.
- ``vartrack``: a chain ``VAR A = 48213`` … ``VAR B = VAR A`` … spread through the filler (plus a
  distractor chain); asked which variables hold the value.
- ``qa``: the sample documents with their ``.qa.json`` ground truth (their own length).

A sample depends only on (task, length, depth, seed): the facts on (task, seed) — so a seed asks
the same thing across the depth × length grid — and the filler on (seed, length).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sekv_core.documents import load_document
from sekv_core.errors import SekvError

from .haystack import filler, plant

GENERATED = ("needle", "multikey", "multivalue", "vartrack")
TASKS = (*GENERATED, "qa")
SAMPLE_DOCS = Path(__file__).resolve().parents[1] / "sample_docs"  # beside the package

KEYS = [
    "the Saltmarsh observatory",
    "the Kelvedge boathouse",
    "the Ormsby seed vault",
    "the Tallowgate signal box",
    "the Pennock ferry office",
    "the Wrenlow clock tower",
    "the Cardle Point beacon",
    "the Hesketh cider press",
    "the Marrow Lane depot",
    "the Gullholm pump house",
    "the Fenwright archive",
    "the Brindle quarry office",
]
MULTIKEY_FACTS = 4  # the asked fact + distractors
MULTIVALUE_VALUES = 3
VARTRACK_HOPS = 3  # variables in the asked chain: one assigned the value, then copies
VARTRACK_DISTRACTOR = 2  # variables in a second chain holding another value

Placed = list[tuple[float, str]]  # (relative depth, fact sentence)


@dataclass(frozen=True)
class Question:
    question: str
    answers: tuple[str, ...]
    mode: str  # "all" | "any"


@dataclass(frozen=True)
class Sample:
    """One benchmark document and its questions.

    ``length`` is the target in tokens (a ``qa`` document's own length); ``depth`` the relative
    position of the asked fact (the first of several; ``None`` for ``qa``); ``source`` the file a
    ``qa`` sample was read from (generated samples have none).
    """

    task: str
    length: int
    depth: float | None
    seed: int
    text: str
    questions: tuple[Question, ...]
    source: Path | None = None

    @property
    def name(self) -> str:
        if self.source is not None:
            return f"{self.task}-{self.source.stem}"
        return f"{self.task}-{self.length}-d{round(100 * self.depth):02d}-s{self.seed}"


def make_sample(task: str, tokenizer, length: int, depth: float, seed: int) -> Sample:
    """The generated ``task`` document of about ``length`` tokens (measured with ``tokenizer``)."""
    if task not in GENERATED:
        raise SekvError(f"unknown generated task {task!r}; choose from {', '.join(GENERATED)}")
    rng = random.Random(f"{task}:{seed}")
    facts, question = FACTS[task](rng, depth)
    fact_tokens = sum(count_tokens(tokenizer, " " + fact) for _, fact in facts)
    sentences = filler(tokenizer, length - fact_tokens, random.Random(f"filler:{seed}:{length}"))
    text = plant(sentences, facts)
    while count_tokens(tokenizer, text) > length and len(sentences) > 1:  # a sentence or two
        sentences.pop()
        text = plant(sentences, facts)
    return Sample(task, length, depth, seed, text, (question,))


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def spread(depth: float, n: int) -> list[float]:
    """``n`` depths: the first at ``depth``, the rest evenly between it and the end."""
    return [depth + (1 - depth) * k / n for k in range(n)]


def codes(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct five-digit codes."""
    return [str(v) for v in rng.sample(range(10_000, 100_000), n)]


def needle(rng: random.Random, depth: float) -> tuple[Placed, Question]:
    key, (value,) = rng.choice(KEYS), codes(rng, 1)
    fact = f"The access code for {key} is {value}."
    return [(depth, fact)], Question(f"What is the access code for {key}?", (value,), "any")


def multikey(rng: random.Random, depth: float) -> tuple[Placed, Question]:
    keys, values = rng.sample(KEYS, MULTIKEY_FACTS), codes(rng, MULTIKEY_FACTS)
    depths = [depth] + [rng.random() for _ in keys[1:]]  # distractors anywhere
    facts = [
        (d, f"The access code for {k} is {v}.")
        for d, k, v in zip(depths, keys, values, strict=True)
    ]
    return facts, Question(f"What is the access code for {keys[0]}?", (values[0],), "any")


def multivalue(rng: random.Random, depth: float) -> tuple[Placed, Question]:
    key, values = rng.choice(KEYS), codes(rng, MULTIVALUE_VALUES)
    depths = spread(depth, MULTIVALUE_VALUES)
    facts = [
        (d, f"One of the access codes for {key} is {v}.")
        for d, v in zip(depths, values, strict=True)
    ]
    question = f"What are the access codes for {key}? Name all of them."
    return facts, Question(question, tuple(values), "all")


def var_names(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct five-letter variable names."""
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    return names


def chain(names: list[str], value: str, depths: list[float]) -> Placed:
    """``VAR names[0] = value`` then each next name copies the one before."""
    hops = zip(depths[1:], names[:-1], names[1:], strict=True)
    return [(depths[0], f"VAR {names[0]} = {value}.")] + [
        (d, f"VAR {b} = VAR {a}.") for d, a, b in hops
    ]


def vartrack(rng: random.Random, depth: float) -> tuple[Placed, Question]:
    names = var_names(rng, VARTRACK_HOPS + VARTRACK_DISTRACTOR)
    asked, other = names[:VARTRACK_HOPS], names[VARTRACK_HOPS:]
    value, other_value = codes(rng, 2)
    facts = chain(asked, value, spread(depth, VARTRACK_HOPS))
    facts += chain(other, other_value, sorted(rng.random() for _ in other))
    # the phrasing under which the default model names a chain's variables (docs/design.md)
    question = f"List the names of every VAR whose value is {value}."
    return facts, Question(question, tuple(asked), "all")


FACTS: dict[str, Callable[[random.Random, float], tuple[Placed, Question]]] = {
    "needle": needle,
    "multikey": multikey,
    "multivalue": multivalue,
    "vartrack": vartrack,
}


def qa_samples(tokenizer, paths: list[Path] | None = None) -> list[Sample]:
    """One ``qa`` sample per document with a ``.qa.json`` beside it (default: the sample docs)."""
    if paths is None:
        paths = sorted(
            p
            for p in SAMPLE_DOCS.glob("*")
            if p.suffix in {".pdf", ".md", ".txt"} and p.with_suffix(".qa.json").is_file()
        )
        if not paths:
            raise SekvError(f"the qa task needs the sample documents; none found in {SAMPLE_DOCS}")
    samples = []
    for path in paths:
        qa_file = path.with_suffix(".qa.json")
        if not qa_file.is_file():
            raise SekvError(f"no ground truth for '{path}': expected {qa_file}")
        items = json.loads(qa_file.read_text())
        questions = tuple(Question(i["question"], (i["answer"],), "all") for i in items)
        text = load_document(path).text
        samples.append(
            Sample("qa", count_tokens(tokenizer, text), None, 0, text, questions, source=path)
        )
    return samples
