"""The answering model reads the best passages again: ranked first / in the first three, by the
weight of its judgement (0: words and meaning alone), on a generated folder.

    python docs/history/finding-model.py FOLDER DOCUMENTS TOKENS FACTS SEED

(one thread; $SEKV_HOME's index is built or reused). Writes nothing; prints one line per weight.
"""

import sys
import time
from pathlib import Path

import torch

import sekv_core.index.ranking as ranking
from sekv_core.api import Library
from sekv_core.collection import select_documents
from sekv_core.models import load_model
from sekv_bench.folder import questions, write_collection

torch.set_num_threads(1)
folder, documents, tokens, facts, seed = Path(sys.argv[1]), *map(int, sys.argv[2:6])
loaded = load_model(None)
planted = write_collection(loaded.tokenizer, folder, documents, tokens, facts, seed)
library = Library(loaded, select_documents([folder]), "sekv")
library.rank("a first question loads the passages")
reader = library.finder.likelihood
for weight in (0.0, 0.1, 0.2, 0.3, 0.5, 1.0, 100.0):
    ranking.MODEL_WEIGHT = weight
    library.finder.likelihood = reader if weight else None
    library.ranked = None
    rows: dict[str, list[list[int]]] = {}
    seconds = []
    for kind, question, need in questions(planted):
        start = time.perf_counter()
        names = [library.entries[r.index].path.name for r in library.rank(question)]
        seconds.append(time.perf_counter() - start)
        rows.setdefault(kind, []).append([names.index(p.path.name) for p in need])
    line = [f"weight {weight}:"]
    for kind, ranks in rows.items():
        first = sum(max(r) < len(r) for r in ranks)  # each needed document among the first
        top3 = sum(max(r) < 3 for r in ranks)
        line.append(f"{kind} first {first}/{len(ranks)}, first three {top3}/{len(ranks)};")
    line.append(f"median {sorted(seconds)[len(seconds) // 2]:.2f} s")
    print(" ".join(line), flush=True)
