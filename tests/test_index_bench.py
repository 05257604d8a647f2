"""`sekv bench index` end to end on a tiny random model's tokenizer: every figure of each size."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from sekv_cli.main import app


def test_bench_index_reports_every_size(tmp_path, tiny_model_dirs):
    out = tmp_path / "run"
    args = ["bench", "index", "--documents", "6", "--tokens", "1200", "--sizes", "3,6",
            "--model", str(tiny_model_dirs["llama"]), "--out", str(out), "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["documents"] for r in rows] == [3, 6]
    assert rows[0]["tokens"] < rows[1]["tokens"] and rows[0]["passages"] < rows[1]["passages"]
    for r in rows:
        assert r["build_s"] > 0 and r["bytes_per_1k_tokens"] > 0 and r["open_s"] > 0
        assert r["rank_s_median"] > 0 and r["questions"] >= 1
    assert "| 6 |" in (out / "results.md").read_text()
