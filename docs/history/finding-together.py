"""Reading together: the best document alone, within a margin of it, or always three (sample docs)."""
import json, sys
from pathlib import Path
import sekv_core.api as api
from sekv_core.api import open_documents
from sekv_core.models import load_model
from sekv_core.config import MethodSettings
from sekv_bench.score import is_correct
root = Path("/work/main/sample_docs")
qa = [(root / "handbook.pdf", q) for q in json.loads((root / "handbook.qa.json").read_text())]
qa += [(root / "lighthouse.md", q) for q in json.loads((root / "lighthouse.qa.json").read_text())]
loaded = load_model(None, device="cpu")
for margin in (0.0, 0.1, 0.2, 9.0):
    api.TOGETHER_MARGIN = margin
    lib = open_documents(root, loaded, settings=MethodSettings(warn=lambda m: None))
    right = first = cited = 0
    for path, q in qa:
        a = lib.ask(q["question"], max_new_tokens=32)
        ok = is_correct(a.answer, [q["answer"]], "all")
        right += ok; first += a.document["path"] == str(path)
        cited += any(s["path"] == str(path) for s in a.sources)
        print(margin, ok, len(a.routing["read_together"]), Path(a.document["path"]).name, q["question"][:40], "|", a.answer[:60].replace("\n", " "), flush=True)
    print(f"margin {margin}: right {right}/{len(qa)}, own document first {first}, cited {cited}", flush=True)
    lib.close()
