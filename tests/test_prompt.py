import pytest
from transformers import AutoTokenizer

from sekv_core.errors import SekvError
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


HISTORY = [("Who is the keeper?", "Orla."), ("Since when?", "Since 1987.")]


def test_history_joins_the_question_part_as_earlier_turns(tiny_model_dirs):
    tok = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])
    tpl = chat_template(tok)
    doc, question = "The keeper is named Orla.", "Where does she live?"
    ctx = encode_context(tok, tpl, doc)
    q_ids = encode_question(tok, tpl, question, HISTORY)
    turn = "<|im_end|>\n<|im_start|>user\n"
    assert tok.decode(q_ids) == (
        f"{tpl.middle}Who is the keeper?{tpl.tail}Orla.{turn}Since when?{tpl.tail}Since 1987."
        f"{turn}{question}{tpl.tail}"
    )
    # the whole prompt is the template's own rendering of the conversation, document once ...
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"Document:\n{doc}\n\nQuestion: Who is the keeper?"},
        {"role": "assistant", "content": "Orla."},
        {"role": "user", "content": "Since when?"},
        {"role": "assistant", "content": "Since 1987."},
        {"role": "user", "content": question},
    ]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.decode(ctx.ids + q_ids) == rendered
    # ... after the same context: the head, and so every stored context, is unchanged
    assert encode_context(tok, chat_template(tok), doc).ids == ctx.ids
    # without history the question part is what a single question always had
    assert encode_question(tok, tpl, question, ()) == encode_question(tok, tpl, question)


def test_plain_format_history_is_question_and_answer_lines(tiny_model_dirs):
    tok = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])
    tok.chat_template = None
    tpl = chat_template(tok)
    q_ids = encode_question(tok, tpl, "Where?", HISTORY)
    assert tok.decode(q_ids) == (
        "\n\nQuestion: Who is the keeper?\nAnswer: Orla.\nQuestion: Since when?\n"
        "Answer: Since 1987.\nQuestion: Where?\nAnswer:"
    )


NO_SYSTEM = (  # like Mistral's: no system turn
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
    "{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
SYSTEM_LAST = (  # the system prompt moves to the last user turn
    "{% for m in messages %}{% if m['role'] != 'system' %}{% if loop.last %}"
    "[sys] {{ messages[0]['content'] }} {% endif %}[{{ m['role'] }}] {{ m['content'] }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


def test_history_through_a_template_without_a_system_turn(tiny_model_dirs):
    tok = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])
    tok.chat_template = NO_SYSTEM
    tpl = chat_template(tok)
    assert tpl.head == f"[user] {SYSTEM_PROMPT}\n\nDocument:\n"
    text = tok.decode(encode_question(tok, tpl, "Where?", HISTORY[:1]))
    turn = "\n[assistant] Orla.\n[user] Where?\n[assistant] "
    assert text == f"\n\nQuestion: Who is the keeper?{turn}"


def test_a_template_that_would_change_the_head_is_refused(tiny_model_dirs):
    tok = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])
    tok.chat_template = SYSTEM_LAST
    tpl = chat_template(tok)
    with pytest.raises(SekvError, match="before the document"):
        encode_question(tok, tpl, "Where?", HISTORY)
