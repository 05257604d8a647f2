"""`sekv bench folder` runs end to end on a tiny random model: every figure reported, the
collection written the same way twice, one added document read alone (no figure asserted)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from sekv_bench.folder import write_collection
from sekv_cli.main import app
from sekv_core.models import load_model


def test_the_collection_is_the_same_each_time_facts_in_some_documents(tmp_path, tiny_model_dirs):
    tokenizer = load_model(str(tiny_model_dirs["llama"]), device="cpu").tokenizer
    planted = write_collection(tokenizer, tmp_path / "a", 8, 2400, 3)
    again = write_collection(tokenizer, tmp_path / "b", 8, 2400, 3)
    assert [p.path.name for p in planted] == ["report-001.md", "report-004.md", "report-006.md"]
    for p, q in zip(planted, again, strict=True):
        assert p.path.read_text() == q.path.read_text() and p.fact == q.fact
        assert p.fact.fact.rstrip(".") in p.path.read_text()
    assert len(list((tmp_path / "a").glob("*.md"))) == 8


def test_bench_folder_reports_every_figure(tmp_path, tiny_model_dirs):
    out = tmp_path / "run"
    args = ["bench", "folder", "--documents", "3", "--tokens", "600", "--facts", "2",
            "--max-new-tokens", "3", "--model", str(tiny_model_dirs["qwen2"]), "--out", str(out),
            "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert len(data["rows"]) == 5 and {r["kind"] for r in data["rows"]} == {
        "exact", "paraphrased", "two documents",
    }  # fmt: skip
    two = next(r for r in data["rows"] if r["kind"] == "two documents")
    assert len(two["documents"]) == 2 and len(two["expected"]) == 2
    s = data["summary"]
    assert s["documents"] == 3 and s["cold"]["stores_built"] >= 1  # only what it read
    assert s["cold"]["stores_built"] + s["ingest_built"] == 3
    assert s["index"]["passages"] > 0 and s["cold"]["first_token_s"] > 0
    assert s["added"]["read"] == 1 and s["added"]["documents"] == 4
    assert not (out / "collection" / "added-report.md").exists()
    assert s["resident_per_document_bytes"] > 0 and s["held_while_answering_bytes"] > 0
    for name in ("results.md", "results.jsonl", "summary.json"):
        assert (out / name).exists()
    assert "| answers right |" in (out / "results.md").read_text()
