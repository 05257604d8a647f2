"""Which attention rule names an answer's sources: the comparison behind sekv_core.sources.

Input: per-step answer attention dumped by a probe (a list of dicts with "steps" (S, L, H, T)
float16 — each step's attention per layer and KV head over the context, group heads summed /
all query heads — "doc_start", "offsets", "text", "answers", "ok"). Prints, per rule and per
sentence splitter, how many correct answers have the ground truth in their first source.
"""

import sys

import numpy as np
import torch

from sekv_core.passages import sentence_index
from sekv_core.sources import sentence_ends

rows = torch.load(sys.argv[1], weights_only=False)


def by_line(text, starts):  # sentences cut at every line break (the passages' rule)
    return sentence_index(text, starts)


def wrapped(text, starts):  # wrapped lines joined (the rule adopted)
    return np.searchsorted(sentence_ends(text), starts, side="right")


RULES = {
    "sum over steps, layers, heads": lambda st: st.sum((0, 1, 2)),
    "sum, later half of the layers": lambda st: st[:, st.shape[1] // 2 :].sum((0, 1, 2)),
    "max over steps of the sum": lambda st: st.sum((1, 2)).amax(0),
    "sum of the excess over the median step": lambda st: (
        st.sum((1, 2)) - st.sum((1, 2)).median(0).values
    ).clamp_min(0).sum(0),
    "peak: max over steps, layers, heads": lambda st: st.amax((0, 1, 2)),
}

for split_name, split in (("line breaks", by_line), ("wrapped lines joined", wrapped)):
    for name, rule in RULES.items():
        hit = n = 0
        for r in rows:
            if not r["ok"] or r["steps"] is None:
                continue
            st = r["steps"].float()[..., r["doc_start"] :]
            off = np.asarray(r["offsets"]).reshape(-1, 2)
            sent = split(r["text"], off[:, 0])
            per = np.bincount(sent, weights=rule(st).double().numpy())
            toks = np.flatnonzero(sent == int(np.argmax(per)))
            text = r["text"][off[toks[0], 0] : off[toks[-1], 1]].lower()
            hit += all(a.lower() in text for a in r["answers"])
            n += 1
        print(f"{split_name:22s} {name:40s} {hit}/{n}")
