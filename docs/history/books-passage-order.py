"""The passages a book's answer pinned, read again as a fresh document with full KV: in
document order, and ordered by rank with the best passage last (docs/history/books-dev.md).

    python docs/history/books-passage-order.py KIND:PATH ...

KIND: ``needles`` (the book of ``scripts/bench_book.py needles``), ``hay`` (a haystack of
``sekv_bench.haystack.haystack`` with ``NEEDLES[0]``) or ``bookS`` (a ``sekv bench books`` book of
seed S). The passages go to ``./passage-order/``. Run at the commit the history names (it reads
the pinned passages of that code's answer).
"""
import sys, json
from pathlib import Path
from sekv_core.engine import Session
from sekv_core.models import load_model
from sekv_core.documents import load_document
from sekv_core.config import MethodSettings
from sekv_bench.book import planted_facts, needle_facts, DEPTHS
from sekv_bench.haystack import NEEDLES
from sekv_bench.score import is_correct
loaded = load_model()
tmp = Path("passage-order"); tmp.mkdir(exist_ok=True)
for spec in sys.argv[1:]:
    kind, path = spec.split(":", 1); path = Path(path)
    doc = load_document(path)
    s = Session(loaded, doc, "sekv", MethodSettings()); m = s.method
    text = doc.text; offsets = m.store.trace["offsets"]
    if kind == "needles":
        qs = [(f.question, f.answer) for f in needle_facts(DEPTHS)]
    elif kind.startswith("book"):
        qs = [(f.question, f.answer) for f in planted_facts(6, int(kind[4:]))]
    else:
        qs = [(NEEDLES[0].question, NEEDLES[0].answer)]
    for i, (q, a) in enumerate(qs):
        ans = s.ask(q, 32)
        pin = m.policy.pinned.cpu(); sc = m.policy.pinned_scores.cpu()
        st, en = m.spans.starts.long().cpu(), m.spans.ends.long().cpu()
        groups = []
        for j in pin.nonzero().flatten().tolist():
            if groups and groups[-1][-1] == j - 1: groups[-1].append(j)
            else: groups.append([j])
        pieces = [(max(float(sc[j]) for j in g), text[int(offsets[st[g[0]], 0]):int(offsets[en[g[-1]] - 1, 1])].strip()) for g in groups]
        out = dict(q=q[:30], sekv=is_correct(ans.answer, [a], "all"))
        for name, order in (("doc", pieces), ("best_last", sorted(pieces, key=lambda p: p[0]))):
            p = tmp / f"{path.stem}-{i}-{name}.txt"; p.write_text("\n\n".join(t for _, t in order))
            f = Session(loaded, load_document(p), "full", MethodSettings())
            fa = f.ask(q, 32)
            out[name] = is_correct(fa.answer, [a], "all"); out[name + "_ans"] = fa.answer[:50]
        print(json.dumps(out), flush=True)
