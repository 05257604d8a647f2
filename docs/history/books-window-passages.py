"""Experiment: passage reading (two-stage, neutral-calibrated) for documents within the window."""
import json, sys, collections
from pathlib import Path
from transformers import DynamicCache
from sekv_core.methods.sekv import SeKV
from sekv_core.attention import sekv_attention
from sekv_core.decode import PositionedStep, greedy
from sekv_core.prompt import stop_ids
from sekv_core.models import load_model
from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.config import MethodSettings
from sekv_bench.book import planted_facts
from sekv_bench.score import is_correct

def generate(self, question_ids, max_new_tokens):
    model, device, spans = self.loaded.model, self.loaded.device, self.spans
    self.policy = self.new_policy(); spans.clear()
    spans.pool_end = len(self.context)  # question-time reading starts after the document
    with sekv_attention(model):
        self.pin_passages(question_ids)
        spans.pool_end = None
        local = DynamicCache(config=model.config)
        self.step = step = PositionedStep(model, local, len(self.context), device, sekv_memory=spans, sekv_policy=self.policy)
        yield from greedy(step, question_ids, stop_ids(self.loaded.tokenizer), max_new_tokens)
SeKV.generate = generate
loaded = load_model()
tally = collections.Counter()
for seed in (1, 2, 3):
    # argv[1]: the books/ folder of `sekv bench books --lengths 7000 --seeds 1,2,3`
    doc = load_document(Path(sys.argv[1]) / f"book-7000-s{seed}.md")
    s = Session(loaded, doc, "sekv", MethodSettings())
    for f in planted_facts(6, seed):
        for kind, q in (("exact", f.question), ("para", f.paraphrase)):
            a = s.ask(q, 32)
            ok = is_correct(a.answer, [f.answer], "all"); tally[kind] += ok
            print(seed, kind, ok, a.answer[:80].replace("\n", " "), flush=True)
print(dict(tally))
