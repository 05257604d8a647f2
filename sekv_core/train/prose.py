"""Topical prose training documents: one topic's filler sentences with facts planted at random
depths.

Sentences are assembled from the parts written here (subjects, verbs, objects, clauses of four
topics), so nothing is downloaded or copied. Deterministic for a seed.
"""

from __future__ import annotations

import random

from .facts import FIRST, LAST, Fact, TrainDoc

TOPICS = {
    "laboratory": (
        [
            "The spectrometer",
            "A visiting chemist",
            "The night technician",
            "The safety officer",
            "The cold-storage unit",
            "A graduate student",
            "The calibration rig",
            "The lab manager",
        ],
        [
            "logged",
            "recalibrated",
            "sampled",
            "labelled",
            "filtered",
            "weighed",
            "sealed",
            "photographed",
        ],
        [
            "the reagent shelf",
            "twelve culture plates",
            "the fume hood",
            "the pressure valves",
            "a batch of soil cores",
            "the backup freezer",
            "the microscope slides",
            "the waste bins",
        ],
    ),
    "farm": (
        [
            "The dairy herd",
            "A contractor",
            "The farm manager",
            "The apprentice",
            "The irrigation crew",
            "Two seasonal pickers",
            "The vet",
            "The grain dryer",
        ],
        ["checked", "ploughed", "fenced", "harvested", "watered", "counted", "moved", "fed"],
        [
            "the east paddock",
            "the barley field",
            "the hay bales",
            "the drainage ditch",
            "the young calves",
            "the apple rows",
            "the feed silo",
            "the tractor shed",
        ],
    ),
    "transit": (
        [
            "The night bus",
            "A signal engineer",
            "The depot supervisor",
            "The ticket office",
            "The tram line",
            "A maintenance gang",
            "The control room",
            "The timetable team",
        ],
        [
            "delayed",
            "rerouted",
            "serviced",
            "inspected",
            "replaced",
            "cleaned",
            "scheduled",
            "tested",
        ],
        [
            "the northern loop",
            "the brake pads",
            "the platform lights",
            "the points at the junction",
            "route nine",
            "the ticket machines",
            "the overhead wires",
            "the winter timetable",
        ],
    ),
    "shipping": (
        [
            "The container ship",
            "A harbour pilot",
            "The customs desk",
            "The crane operator",
            "The cargo agent",
            "The tugboat crew",
            "The port authority",
            "A deckhand",
        ],
        ["unloaded", "weighed", "declared", "secured", "towed", "stacked", "refuelled", "cleared"],
        [
            "forty reefer boxes",
            "the grain hold",
            "the mooring lines",
            "berth six",
            "the manifest",
            "the bunker tanks",
            "a pallet of machine parts",
            "the gangway",
        ],
    ),
}
CLAUSES = [
    "before noon",
    "during the night shift",
    "without incident",
    "as the rain started",
    "for the second time this month",
    "under supervision",
    "ahead of the audit",
    "after a short delay",
    "while the others were at lunch",
    "according to the log",
]
ROLES = [
    "chief inspector",
    "duty officer",
    "records keeper",
    "fleet coordinator",
    "quality lead",
    "site steward",
    "budget holder",
    "first aider",
]
THINGS = [
    "spare key cabinet",
    "backup generator",
    "visitor logbook",
    "first-aid kit",
    "radio charger",
    "fire blanket",
    "master ledger",
    "pump controller",
]
PLACES = ["room", "locker", "bay", "cabinet", "shelf", "hangar"]
CODES = ["access code", "batch number", "permit number", "reference code"]


def _fact(rng: random.Random, topic: str) -> Fact:
    kind = rng.randrange(3)
    if kind == 0:
        name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        role = rng.choice(ROLES)
        return Fact(
            f"The {role} of the {topic} team is {name}.",
            f"Who is the {role} of the {topic} team?",
            name,
        )
    if kind == 1:
        thing, place = rng.choice(THINGS), rng.choice(PLACES)
        number = rng.randrange(100, 1000)
        return Fact(
            f"The {thing} is kept in {place} {number}.",
            f"Where is the {thing} kept?",
            f"{place} {number}",
        )
    code = rng.choice(CODES)
    value = f"{rng.choice('KLMNPRSTVXZ')}{rng.choice('ABDEGHJ')}-{rng.randrange(1000, 10000)}"
    subject = rng.choice(TOPICS[topic][2])
    return Fact(
        f"The {code} for {subject} is {value}.",
        f"What is the {code} for {subject}?",
        value,
    )


def make_doc(tokenizer, tokens: int, facts: int, seed: int) -> TrainDoc:
    """About ``tokens`` tokens of one topic's filler with ``facts`` facts at random depths."""
    rng = random.Random(f"sekv-train-{seed}")
    topic = rng.choice(sorted(TOPICS))
    subjects, verbs, objects = TOPICS[topic]
    sentences, count = [], 0
    while count < tokens:
        s = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}"
        s += f" {rng.choice(CLAUSES)}." if rng.random() < 0.7 else "."
        sentences.append(s)
        count += len(tokenizer(" " + s, add_special_tokens=False)["input_ids"])
    planted: list[Fact] = []
    while len(planted) < facts:
        f = _fact(rng, topic)
        if all(f.question != p.question for p in planted):
            planted.append(f)
    for f in planted:
        sentences.insert(rng.randrange(len(sentences) + 1), f.sentence)
    paragraphs = [" ".join(sentences[i : i + 6]) for i in range(0, len(sentences), 6)]
    return TrainDoc("\n\n".join(paragraphs), planted, topic)
