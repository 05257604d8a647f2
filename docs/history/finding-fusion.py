"""Which fusion ranks the planted fact's document first: meaning, words, sums, RRF."""
import sys, time, os
from pathlib import Path
import numpy as np
from transformers import AutoTokenizer
from sekv_core.models import load_model
from sekv_bench.folder import write_collection
from sekv_core.collection import document_files
from sekv_core.index.catalog import Catalog
from sekv_core.index.embedder import load_embedder
from sekv_core.index.ranking import Finder, _best_per_content

docs, tokens, facts = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
out = Path(f"/tmp/exp/coll-{docs}-{tokens}")
loaded = load_model(None, device="cpu")
planted = write_collection(loaded.tokenizer, out, docs, tokens, facts, 0)
files, _ = document_files([out])
t = time.time()
cat = Catalog(Path("/tmp/exp/index.sqlite"))
s = cat.sync(files, [out], embedder=load_embedder)
print("sync", time.time() - t, s.read, s.unchanged, cat.counts())
f = Finder(cat, s.files, load_embedder())
where = {str(p): i for i, p in enumerate(files)}
res = {}
for p in planted:
    for kind, q in (("exact", p.fact.question), ("para", p.fact.paraphrase)):
        meaning, words = f.passage_scores(q)
        target = f.files[where[str(p.path)]].content
        def rank_of(score):
            best = _best_per_content(f.passages.owners, score)
            order = sorted(best, key=lambda c: -score[best[c]])
            return order.index(target) + 1
        def rrf(*ss):
            tot = np.zeros(len(ss[0]))
            for sc in ss:
                r = np.argsort(np.argsort(-sc)) + 1
                tot += np.where(sc > 0, 1 / (60 + r), 0)
            return tot
        for name, sc in {"meaning": meaning, "words": words, "w0.1": meaning + .1 * words,
                         "w0.3": meaning + .3 * words, "w0.5": meaning + .5 * words,
                         "w1": meaning + words, "w2": meaning + 2 * words, "cube0.5": meaning + .5 * words**3, "cube1": meaning + words**3, "thr": meaning + np.clip(words - .5, 0, None), "rrf": rrf(meaning - meaning.min() + 1e-6, words)}.items():
            res.setdefault((kind, name), []).append(rank_of(sc))
for (kind, name), ranks in sorted(res.items()):
    r = np.array(ranks)
    print(f"{kind:6s} {name:8s} top1 {np.mean(r==1):.2f} top3 {np.mean(r<=3):.2f} ranks {ranks}")
