"""Books: the passages found with and without meaning, same stores, one process."""
import json, sys
from pathlib import Path
from sekv_core.models import load_model
from sekv_core.methods.sekv import SeKV
from sekv_bench.books import bench_books, summarize
lengths = [int(x) for x in sys.argv[1].split(",")]
seeds = [int(x) for x in sys.argv[2].split(",")]
out = Path(sys.argv[3])
loaded = load_model(None, device="cpu")
real = SeKV.meaning_scores
res = {}
for name in ("without meaning", "with meaning"):
    SeKV.meaning_scores = real if name == "with meaning" else (lambda self, q: None)
    rows = bench_books(loaded, lengths, seeds, ["sekv-training-free"], out / name.replace(" ", "-"),
                       on_row=lambda r: print(name, r["length"], r["kind"], r["correct"], r["source_holds"], r["answer"][:50], flush=True))
    res[name] = summarize(rows)
for name, summary in res.items():
    for s in summary:
        print(name, s["length"], s["kind"], f"correct {s['correct']}/{s['questions']}", f"source {s['source_holds']}")
json.dump(res, open(out / "ab.json", "w"), indent=1)
