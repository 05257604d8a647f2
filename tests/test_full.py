import torch

from sekv_core.methods import FullKV, MethodSettings
from sekv_core.prompt import chat_template, encode_context, encode_question

DOC = " ".join(f"Item {i} is stored in room {i * 7 % 31}." for i in range(60))


def test_full_kv_matches_generate(tiny_loaded):
    tok, model = tiny_loaded.tokenizer, tiny_loaded.model
    tpl = chat_template(tok)
    ctx = encode_context(tok, tpl, DOC)
    method = FullKV(tiny_loaded, None, ctx, MethodSettings(prefill_chunk=64))  # several chunks
    method.prepare()
    for question in ("Where is item 3?", "Which room holds item 12?"):
        q = encode_question(tok, tpl, question)
        ours = list(method.generate(q, max_new_tokens=12))
        ids = torch.tensor([ctx.ids + q])
        ref = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=-1)
        # the random model rarely emits a stop token; compare the greedy prefix we produced
        assert ours == ref[0, ids.shape[1] : ids.shape[1] + len(ours)].tolist()
        assert len(ours) > 0


def test_each_question_starts_from_the_document(tiny_loaded):
    tok = tiny_loaded.tokenizer
    tpl = chat_template(tok)
    ctx = encode_context(tok, tpl, DOC)
    method = FullKV(tiny_loaded, None, ctx, MethodSettings())
    method.prepare()
    q = encode_question(tok, tpl, "Where is item 3?")
    first = list(method.generate(q, 8))
    list(method.generate(encode_question(tok, tpl, "Something else entirely?"), 8))
    assert list(method.generate(q, 8)) == first
    assert method.memory()["resident_bytes"] == tiny_loaded.spec.kv_bytes(len(ctx), 2)  # fp16 count
