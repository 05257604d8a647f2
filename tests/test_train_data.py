"""The training corpus generator: deterministic, both document shapes, facts answerable."""

from __future__ import annotations

import json
from pathlib import Path

from sekv_core.train.data import make_corpus

SAMPLES = Path(__file__).resolve().parents[1] / "sample_docs"


class WordTokenizer:
    """Counts words (the generator only needs token counts)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}


def test_corpus_is_deterministic_mixed_and_answerable():
    tok = WordTokenizer()
    corpus = make_corpus(tok, 6, seed=3, lengths=(200, 400))
    again = make_corpus(tok, 6, seed=3, lengths=(200, 400))
    assert [d.text for d in corpus] == [d.text for d in again]
    assert make_corpus(tok, 6, seed=4, lengths=(200, 400))[0].text != corpus[0].text
    reports = [d for d in corpus if d.text.startswith("# ")]
    assert len(reports) == 3  # prose and sectioned reports in turn
    for doc in corpus:
        assert 200 <= len(doc.text.split()) <= 400 + 200  # target plus the planted facts
        assert len({f.question for f in doc.facts}) == len(doc.facts) == 4
        for fact in doc.facts:
            assert fact.sentence in doc.text and fact.answer in fact.sentence
    for doc in reports:
        assert doc.text.count("\n## ") >= 2  # numbered sections


def test_training_questions_are_not_the_benchmark_questions():
    """The sample documents' questions (benchmark QA) never appear in the training corpus."""
    asked = {
        q["question"].lower()
        for path in SAMPLES.glob("*.qa.json")
        for q in json.loads(path.read_text())
    }
    corpus = make_corpus(WordTokenizer(), 40, seed=0, lengths=(200, 300))
    trained = {f.question.lower() for d in corpus for f in d.facts}
    assert asked and trained and not asked & trained
