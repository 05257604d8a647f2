"""The folder bench's questions, SeKV only: the best three read together vs those within a margin."""
import json, sys
from pathlib import Path
import sekv_core.api as api
from sekv_core.api import Library
from sekv_core.collection import select_documents
from sekv_core.config import MethodSettings
from sekv_core.documents import load_document
from sekv_core.models import load_model
from sekv_bench.folder import write_collection, questions, found
from sekv_bench.book import fact_chars
from sekv_bench.score import is_correct
loaded = load_model(None, device="cpu")
folder = Path("/tmp/fb50/run/collection")
planted = write_collection(loaded.tokenizer, folder, 50, 300000, 6, 0)
asked = questions(planted)
for margin in [float(x) for x in sys.argv[1].split(",")]:
    api.TOGETHER_MARGIN = margin
    lib = Library(loaded, select_documents([folder]), "sekv", MethodSettings(warn=lambda m: None))
    tally = {}
    for kind, q, needed in asked:
        a = lib.ask(q, 32)
        read = a.routing["read_together"]
        where = [found(a, p.path, fact_chars(load_document(p.path).text, p.fact)) for p in needed]
        t = tally.setdefault(kind, [0, 0, 0, 0, 0])
        t[0] += 1; t[1] += all(str(p.path) in read for p in needed); t[2] += all(w[0] for w in where)
        t[3] += all(w[1] for w in where); t[4] += is_correct(a.answer, [p.fact.answer for p in needed], "all")
        print(margin, kind, len(read), [w for w in where], a.answer[:50].replace("\n", " "), flush=True)
    for kind, t in tally.items():
        print(f"margin {margin} {kind}: of {t[0]} read {t[1]}, doc among sources {t[2]}, sentence {t[3]}, right {t[4]}", flush=True)
    lib.close()
