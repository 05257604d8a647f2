"""Passages: a book's answer reads whole sentences around the spans its question chose."""

from __future__ import annotations

import numpy as np
import torch

from sekv_core.passages import (
    FUSION_K,
    choose,
    fuse,
    placement,
    sentence_index,
    sentence_texts,
    span_sentences,
    specific,
)

TEXT = "One two three. Four five six.\nSeven eight? Nine ten eleven twelve! Thirteen."


def test_spans_are_numbered_by_the_sentence_they_start_in():
    starts = [TEXT.index(w) for w in ("One", "three", "Four", "Seven", "eight", "Nine", "Thirteen")]
    got = span_sentences(TEXT, np.array(starts)).tolist()
    assert got == [0, 0, 1, 2, 2, 3, 4]


def test_best_span_grows_into_its_sentence_with_one_either_side():
    sentences = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    lengths = torch.full((10,), 5)
    scores = torch.zeros(10)
    scores[5] = 1.0  # sentence 2
    chosen = choose(scores, sentences, lengths, budget=100)
    assert chosen.nonzero()[:, 0].tolist() == [2, 3, 4, 5, 6, 7]  # sentences 1, 2, 3


def test_passages_are_added_best_first_within_the_budget():
    sentences = torch.arange(20).repeat_interleave(2)  # 20 sentences of 2 spans
    lengths = torch.full((40,), 4)
    scores = torch.zeros(40)
    scores[[30, 5, 20]] = torch.tensor([3.0, 2.0, 1.0])  # sentences 15, 2, 10
    chosen = choose(scores, sentences, lengths, budget=2 * 24)  # room for two passages
    picked = set(sentences[chosen].tolist())
    assert picked == {14, 15, 16, 1, 2, 3}
    assert int(lengths[chosen].sum()) <= 48
    # spans the question never attended are never read, whatever the budget
    assert not choose(torch.zeros(40), sentences, lengths, budget=1000).any()


def test_overlapping_passages_are_counted_once():
    sentences = torch.arange(10)
    lengths = torch.full((10,), 10)
    scores = torch.zeros(10)
    scores[[4, 5, 7]] = torch.tensor([3.0, 2.0, 1.0])
    # 3..5 (30 tokens); span 5 is read already; 7's passage 6..8 overlaps nothing: 60 > 50
    assert choose(scores, sentences, lengths, budget=50).nonzero()[:, 0].tolist() == [3, 4, 5]
    # with room, 6..8 joins and the tokens they share are counted once
    scores[6] = 0.5
    chosen = choose(scores, sentences, lengths, budget=60)
    assert chosen.nonzero()[:, 0].tolist() == [3, 4, 5, 6, 7, 8]


def test_a_sentence_longer_than_the_budget_is_cut_around_its_best_span():
    sentences = torch.zeros(12, dtype=torch.long)  # one long sentence (a table, no stops)
    lengths = torch.full((12,), 8)
    scores = torch.zeros(12)
    scores[9] = 1.0
    chosen = choose(scores, sentences, lengths, budget=24)
    assert chosen.nonzero()[:, 0].tolist() == [8, 9, 10]


def test_spans_every_question_draws_do_not_outrank_what_this_question_draws():
    question = torch.tensor([0.5, 0.0, 0.08, 0.3, 0.02])
    neutral = torch.tensor([0.45, 0.1, 0.01, 0.3, 0.0])  # span 0: drawn whatever is asked
    got = specific(question, neutral)
    assert torch.allclose(got, torch.tensor([0.05, 0.0, 0.07, 0.0, 0.02]))
    assert int(got.argmax()) == 2 and int(question.argmax()) == 0
    # spans drawn no more than by the neutral question are never read
    sentences, lengths = torch.arange(5), torch.full((5,), 4)
    assert not choose(got, sentences, lengths, budget=100, context=0)[[1, 3]].any()


def test_a_question_as_general_as_the_neutral_one_keeps_its_own_ranking():
    question = torch.tensor([0.2, 0.0, 0.1])
    assert torch.equal(specific(question, question), question)
    assert torch.equal(specific(question, question + 0.1), question)


def test_each_sentence_text_holds_the_characters_numbered_with_it():
    texts = sentence_texts(TEXT)
    assert "".join(texts) == TEXT and texts[1] == " Four five six.\n"
    index = sentence_index(TEXT, np.arange(len(TEXT)))
    for at, sentence in enumerate(index.tolist()):
        before = sum(len(t) for t in texts[:sentence])
        assert before <= at < before + len(texts[sentence])


def test_fused_rankings_favour_spans_both_rank_well_and_keep_either_alone():
    attention = torch.tensor([0.9, 0.0, 0.3, 0.2, 0.0, 0.1])
    words = torch.tensor([0.0, 5.0, 4.0, 4.0, 0.0, 0.5])  # spans 2 and 3: one sentence's
    got = fuse(attention, words)
    # span 4: ranked by neither, never read; span 1: first by its words alone, as span 0 by
    # the attention alone; spans 2 and 3 (good in both) above either
    assert got[4] == 0 and (got[[0, 1, 2, 3, 5]] > 0).all()
    assert torch.isclose(got[0], got[1]) and torch.isclose(got[0], torch.tensor(1 / (FUSION_K + 1)))
    assert got[2] > got[3] > got[0]
    assert torch.isclose(got[3], torch.tensor(1 / (FUSION_K + 3) + 1 / (FUSION_K + 2)))
    # one ranking alone keeps its order
    assert fuse(attention).argsort(descending=True)[:4].tolist() == [0, 2, 3, 5]


def test_passages_are_placed_by_their_best_score_the_best_last():
    chosen = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 1, 1], dtype=torch.bool)
    scores = torch.tensor([0.0, 0.1, 0.5, 0.0, 0.9, 0.0, 0.0, 0.2, 0.1, 0.3])
    # three passages (runs of chosen spans): 1-2 (best 0.5), 4 (0.9), 7-9 (0.3)
    assert placement(chosen, scores).tolist() == [0, 1, 1, 0, 2, 0, 0, 0, 0, 0]
    assert not placement(torch.zeros(4, dtype=torch.bool), torch.ones(4)).any()


def test_coverage_tells_a_question_in_the_texts_words_from_one_in_other_words():
    """Meaning joins a book's ranking only below WORDS_FOUND: a question a sentence says in its
    own words covers more, one asked in other words (or about nothing there) less."""
    from sekv_core.lexical import LexicalIndex
    from sekv_core.passages import WORDS_FOUND

    filler = [f"The {w} market opened on the square at dawn on day {i}." for i, w in
              enumerate(["fish", "flower", "book", "cheese", "cloth", "spice"] * 4)]  # fmt: skip
    fact = "The officer responsible for harbour works in Carrick Bay is Ida Brann."
    index = LexicalIndex(sentence_texts(" ".join([*filler[:12], fact, *filler[12:]])))
    assert index.coverage("Who is the officer responsible for harbour works in Carrick Bay?") > (
        WORDS_FOUND
    )
    assert index.coverage("Which official looks after dock building at Carrick Bay?") < WORDS_FOUND
    assert index.coverage("What colour is the lighthouse?") < WORDS_FOUND
    assert LexicalIndex([]).coverage("anything") == 0.0


def test_a_books_sentences_rank_its_spans_by_meaning(tmp_path):
    """Each span scores its sentence's cosine with the question (the index's sentences, made
    once per text); a paraphrase finds the fact's sentence; an edited file is not used."""
    import numpy as np

    from sekv_core.documents import load_document
    from sekv_core.index.catalog import Catalog
    from sekv_core.methods.book_reading import SentenceMeaning

    sentences = [
        "The harbour master counted forty fishing boats along the north pier this spring.",
        "Our cooperative bakery sells rye loaves and seed rolls from a stall every Saturday.",
        "The ferry to Holm leaves the stone quay at seven o'clock each and every morning.",
        "Snow closed the mountain pass for three whole weeks during the long winter months.",
    ]
    path = tmp_path / "book.md"
    path.write_text(" ".join(sentences))
    document = load_document(path)
    starts = [document.text.index(s) for s in sentences]
    span_chars = np.array([starts[0], starts[0] + 20, starts[1], starts[2], starts[2] + 9,
                           starts[3]])  # fmt: skip
    meaning = SentenceMeaning(document, span_chars)
    scores = meaning.scores("When does the boat to the island depart?")
    assert scores.shape == (6,) and int(scores.argmax()) in (3, 4)
    assert scores[3] == scores[4] and scores[0] == scores[1]  # one sentence, one score
    with Catalog() as catalog:  # kept in the index: a second reading embeds nothing
        assert catalog.counts()["contents"] == 1
    path.write_text("Edited since the store was built. " * 3)
    assert SentenceMeaning(document, span_chars).scores("ferry") is None
