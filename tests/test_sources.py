"""An answer's sources from its attention: sentences, passages, quotes, shares, pages."""

import re
from pathlib import Path

import numpy as np
import torch

from sekv_core.collection import joined_document
from sekv_core.documents import Document
from sekv_core.prompt import Context
from sekv_core.sources import answer_sources, in_documents, quote, sentence_ends, shared_words

WRAPPED = (
    "Welcome to Brackwater\n"
    "Brackwater Cartography Cooperative makes maps, nautical charts and survey data for harbour\n"
    "authorities and walking clubs. This handbook explains how we work together: the hours we\n"
    "keep and the buildings we share.\n"
    "Security\n"
    "The head of the Security team is Marta Quill, who reports directly to the managing\n"
    "director. The health and safety coordinator is Priya Castellan.\n"
)


def sentences(text: str) -> list[str]:
    ends, start, out = sentence_ends(text), 0, []
    for end in ends:
        out.append(" ".join(text[start:end].split()))
        start = end
    return [s for s in out if s]


def test_sentences_survive_wrapped_lines_and_headings_end_their_own():
    assert sentences(WRAPPED) == [
        "Welcome to Brackwater",
        "Brackwater Cartography Cooperative makes maps, nautical charts and survey data for "
        "harbour authorities and walking clubs.",
        "This handbook explains how we work together: the hours we keep and the buildings we "
        "share.",
        "Security",
        "The head of the Security team is Marta Quill, who reports directly to the managing "
        "director.",
        "The health and safety coordinator is Priya Castellan.",
    ]
    md = "# Title\n\nFirst line of a paragraph\nthat wraps here.\n\n- an item\n- another item\n"
    assert sentences(md) == [
        "# Title",
        "First line of a paragraph that wraps here.",
        "- an item",
        "- another item",
    ]


def word_context(text: str, head: int = 3) -> Context:
    """A context whose document tokens are the words of ``text`` (after ``head`` prompt
    tokens)."""
    offsets = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
    return Context(ids=list(range(head + len(offsets))), doc_start=head, offsets=offsets)


def document(text: str, page_starts=(0,)) -> Document:
    return Document(Path("doc.txt"), "0" * 64, text, tuple(page_starts), "txt")


def peaks(context: Context, words: dict[str, float], L: int = 2, H: int = 2) -> torch.Tensor:
    """(L, H, T) attention: a little everywhere, ``words``' weight on their tokens in one
    (layer, head) — and prompt tokens (sinks) heavier than anything."""
    T = len(context.ids)
    attention = torch.full((L, H, T), 0.001)
    attention[:, :, : context.doc_start] = 0.9  # the prompt is not the document
    text_words = [WRAPPED[a:b].strip(".,:") for a, b in context.offsets]
    for word, weight in words.items():
        for i, w in enumerate(text_words):
            if w == word:
                attention[1, 0, context.doc_start + i] = weight
    return attention


def test_first_source_is_the_sentence_the_answer_drew_on():
    ctx = word_context(WRAPPED)
    doc = document(WRAPPED, page_starts=(0, WRAPPED.index("Security\n")))
    attention = peaks(ctx, {"Marta": 0.5, "Quill": 0.4, "maps": 0.05})
    found = answer_sources(
        attention,
        doc,
        ctx,
        [doc.page_of_char(a) for a, _ in ctx.offsets],
        "The head of Security is Marta Quill.",
    )
    first = found[0]
    assert first.text.startswith("The head of the Security team is Marta Quill")
    assert first.text.endswith("managing director.")
    assert first.page == 2
    assert WRAPPED[first.chars[0] : first.chars[1]].startswith("The head of the Security")
    assert first.matched == ("head", "Security", "Marta", "Quill")
    assert 0 < sum(s.share for s in found) <= 1
    assert [s.share for s in found] == sorted((s.share for s in found), reverse=True)
    # the other sentences hold far less than a quarter of the first one's weight: not sources
    assert len(found) == 1


def test_neighbouring_sentences_join_one_passage_and_sources_are_bounded():
    ctx = word_context(WRAPPED)
    doc = document(WRAPPED)
    attention = peaks(ctx, {"Marta": 0.5, "Priya": 0.45})  # two neighbouring sentences
    found = answer_sources(attention, doc, ctx, [1] * len(ctx.offsets), "Marta and Priya")
    assert len(found) == 1
    assert "Marta Quill" in found[0].text and "Priya Castellan" in found[0].text
    everywhere = torch.rand(2, 2, len(ctx.ids)) + 1  # flat: every sentence is as heavy
    assert len(answer_sources(everywhere, doc, ctx, [1] * len(ctx.offsets), "x", limit=3)) <= 3


def test_no_attention_on_the_document_no_sources():
    ctx = word_context(WRAPPED)
    attention = torch.zeros(2, 2, len(ctx.ids))
    attention[..., :3] = 1.0
    assert answer_sources(attention, document(WRAPPED), ctx, [1] * len(ctx.offsets), "a") == []


def test_long_passages_are_quoted_around_their_peak():
    text = " ".join(f"w{i}" for i in range(200)) + "."
    peak = text.index("w150")
    q = quote(text, 0, len(text), peak, width=60)
    assert q.startswith("…") and q.endswith("…")
    assert "w150" in q and len(q) <= 62
    body = q.strip("…").split()
    assert all(re.fullmatch(r"w\d+\.?", w) for w in body)
    assert quote("short one.", 0, 10, 3) == "short one."


def test_shared_words_leave_common_words_out():
    text = "The head of the Security team is Marta Quill, since 2019."
    assert shared_words(text, "the security head is marta quill (2019)") == (
        "head",
        "Security",
        "Marta",
        "Quill",
        "2019",
    )
    assert shared_words(text, "") == ()


def test_sentence_ends_cover_the_text():
    ends = sentence_ends(WRAPPED)
    assert ends[-1] == len(WRAPPED)
    assert np.all(np.diff(ends) > 0)


def test_the_questions_routing_explains_a_source():
    from sekv_core.zoom.trace import ZoomTrace

    trace = ZoomTrace()
    lengths = torch.tensor([4, 4, 4, 4])

    def route(layer, scores, zoom):
        zoom = torch.tensor(zoom, dtype=torch.bool)
        trace.record(layer, 2, zoom, torch.tensor(scores), torch.zeros(2), lengths)

    # layer 0 (the question): head 0 zooms spans 2, 3 (first choice 2), head 1 zooms 0 and 2
    route(0, [[1.0, 0.0, 5.0, 4.0], [9.0, 3.0, 8.0, 2.0]], [[0, 0, 1, 1], [1, 0, 1, 0]])
    # a later step of layer 0 (an answer token) is not the question's routing
    route(0, [[0.0, 9.0, 0.0, 0.0]] * 2, [[0, 1, 0, 0]] * 2)
    route(1, [[0.0, 0.0, 0.0, 9.0]] * 2, [[0, 0, 0, 1]] * 2)  # layer 1: both heads pick 3
    assert trace.question_zoom.tolist() == [1, 0, 2, 3]
    facts = trace.explain(torch.tensor([1, 2]))  # a source of spans 1 and 2
    assert facts["question_heads"] == 2 and facts["rank"] == 2  # span 3 was picked more
    assert facts["first_choice"] == 1  # head 0 of layer 0
    assert facts["layers_zoomed"] == 1 and facts["zoomed_heads"] == 2  # layer 0, both heads
    assert (facts["heads"], facts["spans"], facts["ranked_by"]) == (4, 4, "router")
    book = trace.explain(torch.tensor([0]), scores=torch.tensor([0.5, 0.9, 0.1, 0.2]))
    assert book["rank"] == 2 and book["ranked_by"] == "question"
    assert trace.explain(torch.tensor([], dtype=torch.long)) == {}


def test_sources_of_a_joined_document_are_placed_in_their_files():
    """A collection read as one document (retrieve): each source gets the path, page and
    characters of the file holding its page; one running into the next file is cut there."""
    first = Document(Path("a.pdf"), "1", "Page one text.\n\nThe keeper is Orla.", (0, 16), "pdf")
    second = Document(Path("b.md"), "2", "The miller is Tomasz.", (0,), "md")
    joined = joined_document([first, second])
    orla, tomasz = joined.text.index("Orla"), joined.text.index("Tomasz")
    rows = [
        {"page": 3, "chars": [tomasz - 14, tomasz + 7], "text": "", "matched": []},
        {"page": 2, "chars": [orla - 14, orla + 4], "text": "The keeper is Orla", "matched": []},
        {"page": 2, "chars": [orla - 14, tomasz + 7], "text": "", "matched": []},  # runs on
    ]
    rows[0]["text"] = quote(joined.text, *rows[0]["chars"], rows[0]["chars"][0])
    in_documents(rows, [first, second], "Orla and Tomasz")
    assert [(r["path"], r["page"]) for r in rows] == [("b.md", 1), ("a.pdf", 2), ("a.pdf", 2)]
    assert [second.text[slice(*rows[0]["chars"])], first.text[slice(*rows[1]["chars"])]] == [
        "The miller is Tomasz.",
        "The keeper is Orla",
    ]
    assert rows[0]["text"] == "The miller is Tomasz." and rows[1]["matched"] == []  # as found
    assert rows[2]["chars"] == [orla - 14, len(first.text)]
    assert rows[2]["text"] == "The keeper is Orla." and rows[2]["matched"] == ["Orla"]
