"""A chat's memory: earlier turns read again before each question, the oldest dropped when the
window fills, cleared on reset (tiny random model, full KV)."""

from sekv_core.conversation import Conversation
from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.models import load_model
from sekv_core.prompt import chat_template, encode_context

QUESTION = "Where is item 3?"


def session_near_the_window(tmp_path, model_dir, room: int) -> Session:
    """A full-KV session over a document that leaves about ``room`` window tokens."""
    loaded = load_model(str(model_dir), device="cpu")
    tok = loaded.tokenizer
    lines = [f"Item {i} lies in box {i % 13} of the lighthouse." for i in range(400)]
    doc = tmp_path / "d.txt"

    def left(n: int) -> int:
        doc.write_text(" ".join(lines[:n]))
        context = encode_context(tok, chat_template(tok), load_document(doc).text)
        return loaded.spec.window - len(context)

    lo, hi = 1, len(lines)
    while lo < hi:  # the most lines that still leave ``room``
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if left(mid) >= room else (lo, mid - 1)
    assert room <= left(lo) < room + 20
    return Session(loaded, load_document(doc), "full")


def test_oldest_turns_drop_when_the_window_fills(tmp_path, tiny_model_dirs):
    session = session_near_the_window(tmp_path, tiny_model_dirs["llama"], room=120)
    chat = Conversation(session)
    old, recent = ("Where is item 1?", "In box 1, " * 12), ("And item 2?", "In box 2.")
    chat.turns = [old, recent]
    # an answer reserve that leaves room for the question and the newest turn only
    reserve = session.room() - len(session.question_ids(QUESTION, [recent]))
    assert len(session.question_ids(QUESTION, [old, recent])) + reserve > session.room()
    answer = chat.ask(QUESTION, max_new_tokens=reserve)
    assert chat.dropped == 1
    assert chat.turns == [recent, (QUESTION, answer.answer)]
    assert answer.tokens_generated <= reserve


def test_turns_too_big_for_any_room_all_drop_and_reset_clears(tmp_path, tiny_model_dirs):
    session = session_near_the_window(tmp_path, tiny_model_dirs["qwen2"], room=80)
    chat = Conversation(session)
    chat.turns = [("Where is item 1?", "In box 1. " * 40)]
    reserve = session.room() - len(session.question_ids(QUESTION))
    chat.ask(QUESTION, max_new_tokens=reserve)
    assert chat.dropped == 1 and [q for q, _ in chat.turns] == [QUESTION]
    chat.reset()
    assert chat.turns == [] and chat.dropped == 0
    assert chat.fitting(QUESTION, 4) == []
