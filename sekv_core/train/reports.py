"""Report-style training documents: a titled organisation's report in numbered sections, with
headings, prose, bullet lists and look-up facts (names, numbers with units, dates, named things).

The topical filler of :mod:`sekv_core.train.prose` is one long run of similar sentences; the
documents people ask sekv about are handbooks and reports, whose attention patterns differ
(headings, lists, many distinct facts close together). This generator gives the router that
shape without touching the benchmark's documents: every word list here is its own and the facts
are drawn at random. Deterministic for a seed.
"""

from __future__ import annotations

import random

from .facts import FIRST, LAST, Fact, TrainDoc

ORGS = [
    ("Fenwick Valley Water Board", "water"),
    ("Saltmarsh Ferry Company", "ferry"),
    ("Highmoor Observatory Trust", "observatory"),
    ("Orchard Lane Community Clinic", "clinic"),
    ("Greyhaven Archive Society", "archive"),
    ("Tallow Bridge Printing Works", "print works"),
]
SECTIONS = [
    "Staffing",
    "Buildings and grounds",
    "Equipment",
    "Finance",
    "Safety",
    "Visitors",
    "Training",
    "Stores and supplies",
    "Communications",
    "Incidents",
]
PROSE = [
    "The quarter was quieter than the last, and most of the planned work was finished on time.",
    "Two members of staff were away for part of the period, which slowed the routine checks.",
    "The committee asked for a shorter report this time, so only the main points are listed.",
    "A fuller account of the figures below is kept in the office files for anyone who asks.",
    "Heavy rain in the second month flooded the lower yard twice but did no lasting damage.",
    "Several suppliers changed their delivery days, and the rota was adjusted to match.",
    "The board thanks the volunteers, who gave more hours this quarter than in any before.",
    "Some of the older records were moved to the new shelving in the back room.",
    "Nobody was hurt during the period, and the inspectors raised no formal concerns.",
    "Costs rose slightly because of the price of fuel, as expected in the spring budget.",
    "The new booking system took a few weeks to settle but is now used by everyone.",
    "Work on the roof was postponed until the dry season, as the contractor advised.",
]
ROLE_FACTS = [
    "treasurer",
    "head of maintenance",
    "volunteer coordinator",
    "safety representative",
    "stores clerk",
    "deputy manager",
    "night warden",
    "training officer",
]
NAMED = [
    ("rota software", "is called", ["KESTREL", "BRAMBLE", "TIDEWAY", "ORRERY", "LANTERN"]),
    ("duty vehicle", "is a van nicknamed", ["the Beetle", "Old Grey", "the Tin Can", "Moby"]),
    ("meeting room", "is named", ["the Cobb Room", "the Loft", "Harbour View", "the Snug"]),
    ("office cat", "is called", ["Pepper", "Juniper", "Admiral", "Tansy", "Waffle"]),
]
MEASURES = [  # thing, verb, unit, range, question
    (
        "storage tank",
        "holds",
        "litres",
        (1200, 9800),
        "How many litres does the storage tank hold?",
    ),
    ("main hall", "seats", "people", (40, 400), "How many people does the main hall seat?"),
    ("boundary fence", "is", "metres long", (150, 2400), "How long is the boundary fence?"),
    (
        "emergency generator",
        "runs for",
        "hours on a full tank",
        (6, 72),
        "How long does the emergency generator run on a full tank?",
    ),
    ("repair budget", "is", "pounds a year", (2000, 60000), "How large is the repair budget?"),
]
MONTHS = ["January", "March", "April", "June", "August", "September", "October", "December"]
EVENTS = ["fire drill", "annual inspection", "open day", "stock take", "boiler service"]
ITEMS = [
    "Fire extinguishers were checked and tagged.",
    "The first-aid boxes were restocked.",
    "Keys were counted and the register signed.",
    "Gutters were cleared on the north side.",
    "The alarm panel was tested with the installer.",
    "Old invoices were archived.",
    "The notice board was cleared of stale notices.",
    "Spare bulbs were ordered for the stairwell.",
]


def _report_fact(rng: random.Random, org: str) -> Fact:
    kind = rng.randrange(5)
    if kind == 0:
        role, name = rng.choice(ROLE_FACTS), f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        return Fact(f"The {role} of the {org} is {name}.", f"Who is the {role} of the {org}?", name)
    if kind == 1:
        thing, verb, values = rng.choice(NAMED)
        value = rng.choice(values)
        return Fact(f"The {thing} {verb} {value}.", f"What is the {thing} called?", value)
    if kind == 2:
        thing, verb, unit, (lo, hi), question = rng.choice(MEASURES)
        value = str(rng.randrange(lo, hi))
        return Fact(f"The {thing} {verb} {value} {unit}.", question, value)
    if kind == 3:
        event, day, month = rng.choice(EVENTS), rng.randrange(1, 29), rng.choice(MONTHS)
        when = f"{day} {month}"
        return Fact(f"The next {event} is booked for {when}.", f"When is the next {event}?", when)
    room = f"{rng.choice('ABCDEFG')}{rng.randrange(1, 40)}"
    thing = rng.choice(["spare keys", "visitor badges", "ladder", "petty cash box", "rain gear"])
    return Fact(f"The {thing} are kept in room {room}.", f"Where are the {thing} kept?", room)


def make_report(tokenizer, tokens: int, facts: int, seed: int) -> TrainDoc:
    """About ``tokens`` tokens of a sectioned report with ``facts`` look-up facts in it."""
    rng = random.Random(f"sekv-report-{seed}")
    org, short = rng.choice(ORGS)
    planted: list[Fact] = []
    while len(planted) < facts:
        f = _report_fact(rng, short)
        if all(f.question != p.question for p in planted):
            planted.append(f)
    year = rng.randrange(2019, 2031)
    head = f"# {org}: Quarterly Report, {year}\n\n*Prepared for the board by the office.*"
    blocks, count = [head], len(tokenizer(head, add_special_tokens=False)["input_ids"])
    sections = rng.sample(SECTIONS, len(SECTIONS))
    number = 0
    while count < tokens:
        number += 1
        title = sections[(number - 1) % len(sections)]
        if rng.random() < 0.5:
            body = " ".join(rng.sample(PROSE, rng.randrange(2, 5)))
        else:
            body = "\n".join(f"- {item}" for item in rng.sample(ITEMS, rng.randrange(2, 5)))
        block = f"## {number}. {title}\n\n{body}"
        blocks.append(block)
        count += len(tokenizer("\n\n" + block, add_special_tokens=False)["input_ids"])
    for f in planted:  # each fact into a random section, as prose or as a list item
        i = rng.randrange(1, len(blocks))
        line = f.sentence if rng.random() < 0.5 else f"- {f.sentence}"
        blocks[i] = f"{blocks[i]}\n{line}" if line.startswith("-") else f"{blocks[i]} {line}"
    return TrainDoc("\n\n".join(blocks), planted, short)
