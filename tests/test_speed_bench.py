"""`sekv bench speed`: both methods measured per size, the store built then loaded, the
ratios and results files written (figures are not asserted: a benchmark, not a timed test)."""

import json

from typer.testing import CliRunner

from sekv_bench.speed import forced_tokens, ratio
from sekv_cli.main import app


def test_speed_bench_measures_both_methods_per_size(tiny_model_dirs, tmp_path, sekv_home):
    out = tmp_path / "speed"
    result = CliRunner().invoke(
        app,
        ["bench", "speed", "--sizes", "300,600", "--tokens", "4", "--repeats", "2",
         "--no-processes", "--threads", "1", "--model", str(tiny_model_dirs["llama"]),
         "--out", str(out), "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    rows = data["rows"]
    assert [r["target_tokens"] for r in rows] == [300, 600]
    assert all(r["condition"] == "idle" and "processes" not in r for r in rows)
    for r in rows:
        full, sekv = r["full"], r["sekv"]
        assert full["decode_tokens_per_s"] > 0 and sekv["decode_tokens_per_s"] > 0
        assert full["tokens_decoded"] == sekv["tokens_decoded"] == 4  # teacher-forced
        assert sekv["build_cache_hit"] is False and sekv["load_cache_hit"] is True
        assert full["prefill_s"] > 0 and sekv["build_s"] > 0 and sekv["load_s"] > 0
        assert r["ratios"]["decode"] > 0 and r["ratios"]["build_over_prefill"] > 0
        assert r["ratios"]["process_wall"] is None  # --no-processes
        # each alternating pair's ratio: the SeKV answer over the full-KV answer before it
        pairs = [s / f for f, s in zip(full["decode_runs"], sekv["decode_runs"], strict=True)]
        assert r["decode_pair_ratios"] == [round(x, 4) for x in pairs] and len(pairs) == 2
        assert r["ratios"]["decode_pair_min"] == min(r["decode_pair_ratios"])
        assert r["ratios"]["decode_pair_max"] == max(r["decode_pair_ratios"])
        # the store built twice, each build over the full prefill just before it
        builds = [b / f for f, b in zip(full["prefill_runs"], sekv["build_runs"], strict=True)]
        assert r["build_pair_ratios"] == [round(x, 4) for x in builds] and len(builds) == 2
        assert r["ratios"]["build_pair_min"] == min(r["build_pair_ratios"])
        assert r["ratios"]["build_pair_max"] == max(r["build_pair_ratios"])
        assert r["device_peak_bytes"] is None and r["ratios"]["device_peak"] is None  # a CPU
    assert set(data["summary"][0]) >= {
        "decode", "first_token_fresh", "build_over_prefill", "process_wall",
        "build_rss_over_prefill_rss", "decode_contended",
    }  # fmt: skip
    assert data["machine"]["torch_threads"] == 1 and data["config"]["tokens"] == 4
    assert json.loads((out / "results.json").read_text())["rows"] == rows
    assert "| decode × |" in (out / "results.md").read_text()
    assert not (sekv_home / "stores").exists()  # stores went to the run's own home


def test_forced_tokens_have_the_asked_length_and_ratios_skip_missing(tiny_loaded):
    assert len(forced_tokens(tiny_loaded.tokenizer, 100)) == 100
    assert ratio(1.0, 4.0) == 0.25 and ratio(None, 2.0) is None and ratio(1.0, 0) is None


def test_speed_bench_reports_asks_first_token_after_the_process_started(
    tiny_model_dirs, tmp_path, sekv_home
):
    out = tmp_path / "speed"
    result = CliRunner().invoke(
        app,
        ["bench", "speed", "--sizes", "300", "--tokens", "4", "--repeats", "1", "--threads",
         "1", "--model", str(tiny_model_dirs["llama"]), "--out", str(out), "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["rows"][0]
    for run in ("ask_sekv", "ask_full"):
        asked = row["processes"][run]
        assert 0 < asked["first_token_after_start_s"] < asked["wall_s"], asked
        assert asked["first_token_after_start_s"] > asked["timings"]["first_token_s"]
        assert asked["first_byte_s"] > asked["timings"]["first_token_s"]
        assert 0 < asked["first_byte_warm_s"]
    assert row["ratios"]["process_first_token"] > 0
    assert "| ask 1st byte s full / sekv | warm: full / sekv |" in (out / "results.md").read_text()
