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


def whole_text_tokens(tok, text: str):
    import numpy as np

    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), np.asarray(enc["offset_mapping"]).reshape(-1, 2)


def piece_texts(seed: int = 0) -> list[str]:
    """Texts whose pieces end inside words, runs of white space, numbers, multi-byte
    characters and special tokens."""
    import random

    rng = random.Random(seed)
    parts = list("abcdefgh ") + ["  ", "\n", "\n\n", "Über", "1234", "--", " \t", "é", "😀"]
    parts += ["<|im_end|>", "日本語", "'s", "...", "      ", "The keeper is named Orla. "]
    texts = ["".join(rng.choice(parts) for _ in range(rng.randint(50, 3000))) for _ in range(25)]
    return texts + ["x" * 3000 + " " * 2000 + "y" * 1000, "word " * 2000]


@pytest.mark.parametrize("overlap, piece", [(8, 32), (16, 100), (64, 257), (1024, 4096)])
def test_piecewise_tokenization_is_the_whole_texts(tiny_model_dirs, monkeypatch, overlap, piece):
    import numpy as np

    from sekv_core import prompt
    from sekv_core.documents import load_document

    monkeypatch.setattr(prompt, "OVERLAP_CHARS", overlap)
    tok = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])
    samples = [load_document(f"sample_docs/{n}").text for n in ("lighthouse.md", "handbook.pdf")]
    for text in samples + piece_texts():
        ids, offsets = prompt.encode_text(tok, text, piece=piece)
        want_ids, want_offsets = whole_text_tokens(tok, text)
        assert ids == want_ids and np.array_equal(offsets, want_offsets), text[:60]


@pytest.mark.integration
def test_piecewise_tokenization_is_the_whole_texts_with_the_default_model(
    default_model, monkeypatch
):
    import numpy as np

    from sekv_core import prompt
    from sekv_core.documents import load_document

    tok = default_model.tokenizer
    samples = [load_document(f"sample_docs/{n}").text for n in ("lighthouse.md", "handbook.pdf")]
    for overlap, piece in ((8, 40), (1024, 4096)):
        monkeypatch.setattr(prompt, "OVERLAP_CHARS", overlap)
        for text in samples + piece_texts(1):
            ids, offsets = prompt.encode_text(tok, text, piece=piece)
            want_ids, want_offsets = whole_text_tokens(tok, text)
            assert ids == want_ids and np.array_equal(offsets, want_offsets), text[:60]


def test_a_long_document_is_tokenised_in_bounded_pieces_with_progress(tiny_model_dirs):
    """The tokenizer never sees much more than a piece; progress comes after each piece (a
    Ctrl-C raised there stops the work at once)."""
    from sekv_core import prompt

    tok = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])
    seen = []

    class Recording:
        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, text, **kwargs):
            seen.append(len(text))
            return tok(text, **kwargs)

    text = "The keeper is named Orla and the lamp is lit at dusk. " * 40_000  # 2.2M characters
    told = []
    ctx = encode_context(Recording(), chat_template(tok), text, lambda d, t: told.append((d, t)))
    assert max(seen) <= prompt.PIECE_CHARS
    assert len(told) >= len(text) // prompt.PIECE_CHARS and told[-1] == (len(text), len(text))
    assert all(a[0] < b[0] for a, b in zip(told, told[1:], strict=False))
    assert ctx.offsets[-1][1] == len(text) and len(ctx.offsets) == len(ctx) - ctx.doc_start

    def stop(done, total):
        raise KeyboardInterrupt

    seen.clear()
    with pytest.raises(KeyboardInterrupt):
        encode_context(Recording(), chat_template(tok), text, stop)
    assert sum(seen) < 3 * prompt.PIECE_CHARS  # stopped after the first piece
