from transformers import AutoTokenizer

from sekv_core.prompt import (
    SYSTEM_PROMPT,
    chat_template,
    encode_context,
    encode_question,
    stop_ids,
)


def test_document_once_question_after(tiny_model_dirs):
    tok = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])
    tpl = chat_template(tok)
    doc, question = "The keeper is named Orla.", "Who is the keeper?"
    ctx = encode_context(tok, tpl, doc)
    q_ids = encode_question(tok, tpl, question)
    full = tok.decode(ctx.ids + q_ids)
    assert full.count(doc) == 1 and full.count(question) == 1
    assert full.index(SYSTEM_PROMPT) < full.index(doc) < full.index(question)
    assert full.endswith("<|im_start|>assistant\n")
    # the context's document tokens decode back to the document; offsets index into it
    doc_ids = ctx.ids[ctx.doc_start :]
    assert tok.decode(doc_ids) == doc
    assert len(ctx.offsets) == len(doc_ids)
    assert ctx.offsets[0][0] == 0 and ctx.offsets[-1][1] == len(doc)
    assert tok.convert_tokens_to_ids("<|im_end|>") in stop_ids(tok)


def test_plain_format_without_chat_template(tiny_model_dirs):
    tok = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])
    tok.chat_template = None
    tpl = chat_template(tok)
    assert tpl.head.startswith(SYSTEM_PROMPT)
    assert tpl.tail.endswith("Answer:")
