"""The window baselines: truncate and BM25 retrieval read books through a full-KV window."""

import pytest
import torch

from sekv_core.config import MethodSettings
from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.methods.window import PASSAGE_MAX, Retrieve, Truncate, cut_passages
from sekv_core.prompt import chat_template, encode_question, question_text


def book(tmp_path, sentences: int = 700):
    """A document longer than the tiny models' 2,048-token window, one rare fact mid-way."""
    lines = [f"Item {i} is kept in room {i * 7 % 31} of the east wing." for i in range(sentences)]
    lines[sentences // 2] = "The zephyr quartz lies under the copper lantern."
    path = tmp_path / "book.md"
    path.write_text("\n\n".join(" ".join(lines[i : i + 5]) for i in range(0, sentences, 5)))
    return load_document(path)


@pytest.mark.parametrize("cls", [Retrieve, Truncate])
def test_a_book_is_answered_within_the_window(tiny_loaded, tmp_path, cls):
    document = book(tmp_path)
    session = Session(tiny_loaded, document, cls.name, MethodSettings())
    assert len(session.context) > tiny_loaded.spec.window  # a book for this model
    answer = session.ask("Where does the zephyr quartz lie?", max_new_tokens=4)
    assert answer.tokens_generated > 0 and answer.method == cls.name
    held = session.method.held_tokens
    assert held <= session.method.question_position() < tiny_loaded.spec.window
    assert answer.memory["resident_bytes"] == tiny_loaded.spec.kv_bytes(held, 2)


def test_retrieval_ranks_the_passage_that_shares_the_question_words(tiny_loaded, tmp_path):
    document = book(tmp_path)
    session = Session(tiny_loaded, document, "retrieve", MethodSettings())
    method = session.method
    tok, template = tiny_loaded.tokenizer, chat_template(tiny_loaded.tokenizer)
    question = "Where does the zephyr quartz lie?"
    assert question_text(tok, template, encode_question(tok, template, question)) == question
    chosen = method.select(question)
    assert chosen == sorted(chosen) and len(chosen) < len(method.passages)  # a window's worth
    best = max(range(len(method.texts)), key=lambda i: "zephyr" in method.texts[i])
    assert best in chosen
    used = sum(method.passages[i][1] - method.passages[i][0] for i in chosen)
    assert used <= method.room


def test_passages_end_at_sentence_ends_and_cover_the_document(tiny_loaded, tmp_path):
    document = book(tmp_path, sentences=120)
    enc = tiny_loaded.tokenizer(document.text, return_offsets_mapping=True)
    offsets = [tuple(o) for o in enc["offset_mapping"]]
    passages = cut_passages(document.text, offsets)
    assert passages[0][0] == 0 and passages[-1][1] == len(offsets)
    assert all(a[1] == b[0] for a, b in zip(passages, passages[1:], strict=False))
    assert all(0 < e - s <= PASSAGE_MAX for s, e in passages)
    ends = [document.text[offsets[e - 1][1] - 1] for _, e in passages[:-1]]
    assert sum(c == "." for c in ends) >= len(ends) - 1


def test_truncate_keeps_the_document_head(tiny_loaded, tmp_path):
    document = book(tmp_path)
    session = Session(tiny_loaded, document, "truncate", MethodSettings())
    method = session.method
    assert method.routing()["kept_tokens"] == method.held_tokens - session.context.doc_start
    assert method.held_tokens == method.question_position()


def test_retrieve_names_the_retrieved_sentences_the_answer_drew_on(tiny_loaded, tmp_path):
    """Its answer's attention over the window lands on the document tokens read into it (only
    those of the passages retrieved), and its sources are sentences of those passages."""
    document = book(tmp_path)
    session = Session(tiny_loaded, document, "retrieve", MethodSettings())
    answer = session.ask("Where does the zephyr quartz lie?", max_new_tokens=4)
    method, start = session.method, session.context.doc_start
    weights = method.answer_attention().amax(dim=(0, 1))  # (T,) over the document's context
    assert weights.shape == (len(session.context),)
    read = torch.zeros(len(session.context), dtype=torch.bool)
    for i in method.chosen:
        a, b = method.passages[i]
        read[start + a : start + b] = True
    assert (weights > 0).sum() > 0 and not (weights[~read] > 0).any()
    assert answer.sources and 0 < sum(s["share"] for s in answer.sources) <= 1
    for s in answer.sources:
        c0, c1 = s["chars"]
        assert any(method.starts[i] < c1 and c0 < method.starts[i] + len(method.texts[i])
                   for i in method.chosen)  # fmt: skip
        assert s["text"].strip("…") in " ".join(document.text[c0:c1].split())
        assert s["page"] == 1 and start <= s["start"] < s["end"] <= len(session.context)
    quiet = Session(tiny_loaded, document, "retrieve", MethodSettings(sources=False))
    assert quiet.ask("Where does the zephyr quartz lie?", max_new_tokens=4).sources == []
