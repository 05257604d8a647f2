"""The book task: paraphrased questions that do not hand lexical retrieval the answer, and a
run of every book method on a book beyond a tiny model's window."""

import json

from typer.testing import CliRunner

from sekv_bench.book import PLACES, make_book, planted_facts
from sekv_bench.books import words_shared
from sekv_cli.main import app


def test_paraphrases_share_only_the_place_and_places_are_everywhere(tiny_loaded):
    facts = planted_facts(12, seed=3)
    for f in facts:
        place = next(p for p in PLACES if p in f.fact)
        function_words = {"the", "is", "of", "at", "in"}
        assert words_shared(f.paraphrase, f.fact) <= set(place.lower().split()) | function_words
        assert f.answer in f.fact and f.answer not in f.paraphrase
    book = make_book(tiny_loaded.tokenizer, 8000, facts[:3], seed=3)
    paragraphs = [p for p in book.split("\n\n") if not p.startswith("#")]
    # a place name alone does not point to its fact: every paragraph names a place
    assert len(paragraphs) > 20 and all(any(p in para for p in PLACES) for para in paragraphs)


def test_books_bench_runs_every_method_on_a_book(tiny_model_dirs, tmp_path):
    out = tmp_path / "books"
    result = CliRunner().invoke(
        app,
        ["bench", "books", "--lengths", "2600", "--facts", "2", "--max-new-tokens", "3",
         "--methods", "sekv,retrieve,truncate", "--model", str(tiny_model_dirs["llama"]),
         "--out", str(out), "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["books"]
    assert {r["method"] for r in rows} == {"sekv", "retrieve", "truncate"}
    assert {r["kind"] for r in rows} == {"exact", "paraphrased"} and len(rows) == 3 * 2 * 2
    assert all(r["tokens"] > 2048 for r in rows)  # beyond the tiny model's window
    assert "2K exact" in (out / "results.md").read_text()
