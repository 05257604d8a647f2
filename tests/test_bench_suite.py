"""`sekv bench suite`: task generators, the scorer, the goal check, and the runner end to end."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from sekv_bench.report import goal
from sekv_bench.rows import upgrade
from sekv_bench.score import is_correct, score
from sekv_bench.tasks import GENERATED, count_tokens, make_sample, qa_samples, spread
from sekv_cli.main import app
from sekv_core.errors import SekvError

PNG = b"\x89PNG\r\n\x1a\n"
ROW_KEYS = {
    "sample", "task", "method", "memory_share", "length", "target_length", "depth", "seed",
    "question", "expected", "mode", "score", "correct", "answer", "resident_share",
    "store_share", "ingest_s", "first_token_s", "decode_tps", "routing",
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dirs):
    return AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])


@pytest.mark.parametrize("task", GENERATED)
def test_generators_are_deterministic_per_seed(tokenizer, task):
    a = make_sample(task, tokenizer, 1500, 0.3, seed=1)
    assert a == make_sample(task, tokenizer, 1500, 0.3, seed=1)
    assert a.text != make_sample(task, tokenizer, 1500, 0.3, seed=2).text
    assert a.text != make_sample(task, tokenizer, 1500, 0.7, seed=1).text
    assert 0.8 * 1500 <= count_tokens(tokenizer, a.text) <= 1500
    assert a.name == f"{task}-1500-d30-s1"
    for q in a.questions:
        assert q.mode in ("all", "any") and q.answers
        assert all(answer in a.text for answer in q.answers)


def where(text: str, needle: str) -> float:
    """Relative position of the sentence holding ``needle``."""
    return text.index(needle) / len(text)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9])
def test_asked_facts_sit_at_the_requested_depth(tokenizer, depth):
    needle = make_sample("needle", tokenizer, 3000, depth, seed=3)
    assert where(needle.text, needle.questions[0].answers[0]) == pytest.approx(depth, abs=0.05)
    multikey = make_sample("multikey", tokenizer, 3000, depth, seed=3)
    key = re.search(r"access code for (.+)\?", multikey.questions[0].question).group(1)
    asked = f"The access code for {key} is {multikey.questions[0].answers[0]}."
    assert multikey.text.count("The access code for") == 4  # the asked fact + 3 distractors
    assert where(multikey.text, asked) == pytest.approx(depth, abs=0.05)
    multivalue = make_sample("multivalue", tokenizer, 3000, depth, seed=3)
    spots = [where(multivalue.text, v) for v in multivalue.questions[0].answers]
    assert spots == pytest.approx(spread(depth, 3), abs=0.05)


def resolve(text: str) -> dict[str, str]:
    """Each variable's value, following ``VAR B = VAR A`` copies."""
    assigned = dict(re.findall(r"VAR (\w+) = ((?:VAR )?\w+)\.", text))
    values = {}
    for name in assigned:
        value = assigned[name]
        while value.startswith("VAR "):
            value = assigned[value[4:]]
        values[name] = value
    return values


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_vartrack_chains_resolve_to_the_answer_set(tokenizer, seed):
    sample = make_sample("vartrack", tokenizer, 2000, 0.2, seed)
    (q,) = sample.questions
    value = re.search(r"value is (\d+)", q.question).group(1)
    values = resolve(sample.text)
    assert len(values) == 5  # a 3-variable chain and a 2-variable distractor chain
    assert {name for name, v in values.items() if v == value} == set(q.answers)
    assert q.mode == "all" and len(set(values.values())) == 2
    first = sample.text.index(f"VAR {q.answers[0]} = {value}.")
    assert first / len(sample.text) == pytest.approx(0.2, abs=0.05)


def test_qa_samples_come_from_the_ground_truth(tokenizer, tmp_path):
    samples = qa_samples(tokenizer)
    assert {s.name for s in samples} == {"qa-handbook", "qa-lighthouse"}
    lighthouse = next(s for s in samples if s.name == "qa-lighthouse")
    assert len(lighthouse.questions) == 8 and lighthouse.depth is None
    assert lighthouse.length == count_tokens(tokenizer, lighthouse.text)
    (tmp_path / "notes.md").write_text("Some notes.")
    with pytest.raises(SekvError, match="no ground truth"):
        qa_samples(tokenizer, [tmp_path / "notes.md"])


def test_scorer_on_hand_made_cases():
    assert score("The code is 48213.", ["48213"], "any") == 1.0
    assert score("The code is 4821.", ["48213"], "any") == 0.0
    assert score("Marta   QUILL\nleads it", ["marta quill"], "all") == 1.0  # case, whitespace
    assert score("Tobias Wren", ["Tobias Wrenfield"], "all") == 0.0
    assert score("AAA and CCC", ["AAA", "BBB", "CCC", "DDD"], "all") == 0.5  # partial
    assert score("only BBB", ["AAA", "BBB"], "any") == 1.0
    assert score("", ["AAA"], "all") == 0.0
    assert is_correct("aaa, bbb", ["AAA", "BBB"], "all")
    assert not is_correct("aaa", ["AAA", "BBB"], "all")
    assert is_correct("bbb", ["AAA", "BBB"], "any")
    with pytest.raises(ValueError, match="mode"):
        score("x", ["x"], "most")


def test_goal_lists_where_sekv_falls_short():
    def rows(method, share, task, scores, resident):
        return [
            {"method": method, "memory_share": share, "task": task, "score": s,
             "correct": s == 1, "resident_share": resident, "store_share": 0.0, "ingest_s": 1.0,
             "cache_hit": False, "first_token_s": 0.1, "decode_tps": 10.0}
            for s in scores
        ]  # fmt: skip

    data = (
        rows("full", None, "needle", [1, 1], 1.0)
        + rows("sekv", 0.1, "needle", [1, 0], 0.1)  # below full KV at <= 15%: a miss
        + rows("h2o", 0.1, "needle", [0, 0], 0.1)
        + rows("sekv", 0.5, "needle", [1, 1], 0.5)  # above 15%: not held to full KV
        + rows("h2o", 0.5, "needle", [1, 1], 0.5)
    )
    g = goal(data)
    assert g["checked"] == 3 and not g["holds"]
    (miss,) = g["misses"]
    assert (miss["sekv"], miss["rival"], miss["sekv_accuracy"]) == ("sekv@0.1", "full", 0.5)
    heavy = goal(rows("full", None, "qa", [1], 1.0) + rows("sekv", 0.2, "qa", [1], 0.26))
    assert heavy["checked"] == 0 and not heavy["holds"]
    assert any("never got to <= 15% resident (lowest measured 26.0%)" in n for n in heavy["notes"])
    heavy = goal(rows("sekv", 0.2, "qa", [1], 0.26) + rows("snapkv", 0.2, "qa", [1], 0.2))
    assert [m["why"] for m in heavy["misses"]] == ["more resident memory"]


def run(*args):
    return CliRunner().invoke(app, ["bench", *map(str, args)])


def test_suite_end_to_end_through_the_cli(tiny_model_dirs, tmp_path, sekv_home):
    out = tmp_path / "bench"
    result = run(
        "suite", "--methods", "full,sekv", "--tasks", "needle", "--lengths", "300",
        "--depths", "0.5", "--memory", "0.2,0.5", "--max-new-tokens", "3",
        "--model", tiny_model_dirs["llama"], "--set", "store.segment.min_len=4",
        "--set", "store.segment.max_len=8", "--set", "neighbours=2", "--recall",
        "--out", out, "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["config"]["settings"] == [
        "store.segment.min_len=4", "store.segment.max_len=8", "neighbours=2",
    ]  # fmt: skip
    assert summary["config"]["memory_shares"] == [0.2, 0.5] and summary["config"]["recall"]
    (manifest,) = (sekv_home / "stores").glob("*/manifest.json")  # SeKV's store, built once
    segment = json.loads(manifest.read_text())["settings"]["segment"]
    assert (segment["min_len"], segment["max_len"]) == (4, 8)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == summary["rows"] == 3  # full once + sekv at two memory shares
    assert {(r["method"], r["memory_share"]) for r in rows} == {
        ("full", None),
        ("sekv", 0.2),
        ("sekv", 0.5),
    }
    for r in rows:
        assert ROW_KEYS <= set(r) and r["task"] == "needle" and r["depth"] == 0.5
        assert 0 < r["length"] <= 300 and r["resident_share"] > 0
        assert "budget" not in r and "resident_ratio" not in r
    assert next(r for r in rows if r["method"] == "full")["resident_share"] == 1.0
    sekv = [r["routing"] for r in rows if r["method"] == "sekv"]
    assert {r["neighbours"] for r in sekv} == {2}
    for routing in sekv:  # --recall: the probe's figures beside the answer's own
        assert 0.0 <= routing["recall_vs_oracle"] <= 1.0
        assert 0.0 < routing["mass_captured"] <= 1.0 + 1e-5
        assert 0.0 < routing["oracle_mass_captured"] <= 1.0 + 1e-5
    assert [(c["method"], c["memory_share"]) for c in summary["by_memory_share"]] == [
        ("full", None), ("sekv", 0.2), ("sekv", 0.5),
    ]  # fmt: skip
    assert all(c["recall_vs_oracle"] is not None for c in summary["by_memory_share"][1:])
    assert {c["task"] for c in summary["cells"]} == {"needle"}
    assert json.loads((out / "summary.json").read_text()) == summary
    table = (out / "results.md").read_text()
    assert "| full | – | needle | 300 | 1 |" in table and "## Goal" in table
    for png in ("accuracy_vs_memory.png", "needle_heatmap.png"):
        data = (out / png).read_bytes()
        assert data[:8] == PNG and len(data) > 5000
    assert (out / "samples" / "needle-300-d50-s1.txt").is_file()

    # a second run (another method) merged with the first into one report
    other = tmp_path / "bench2"
    second = run(
        "suite", "--methods", "streaming", "--tasks", "needle", "--lengths", "300",
        "--depths", "0.5", "--memory", "0.2", "--max-new-tokens", "3",
        "--model", tiny_model_dirs["llama"], "--out", other, "--json",
    )  # fmt: skip
    assert second.exit_code == 0, second.output
    merged = run("report", out, other, "--out", tmp_path / "merged", "--json")
    assert merged.exit_code == 0, merged.output
    combined = json.loads(merged.stdout)
    assert combined["rows"] == 4 and combined["config"]["methods"] == ["full", "sekv", "streaming"]
    assert (tmp_path / "merged" / "accuracy_vs_memory.png").read_bytes()[:8] == PNG
    missing = run("report", tmp_path / "nowhere", "--out", tmp_path / "m2")
    assert missing.exit_code == 1 and "not a finished" in missing.output


def test_report_merges_runs_written_with_the_old_keys(tmp_path):
    """Runs written before the names were unified (``budget``, ``resident_ratio``,
    ``store_ratio``) merge with today's."""
    new = {
        "sample": "needle-300-d50-s1", "task": "needle", "method": "sekv", "memory_share": 0.2,
        "target_length": 300, "depth": 0.5, "seed": 1, "score": 1.0, "correct": True,
        "resident_share": 0.18, "store_share": 0.5, "ingest_s": 1.0, "cache_hit": False,
        "first_token_s": 0.1, "decode_tps": 10.0, "routing": {"budget": 128},
    }  # fmt: skip
    old = {k: v for k, v in new.items() if k not in ("memory_share", "resident_share")}
    old |= {"method": "h2o", "budget": 0.2, "resident_ratio": 0.2, "store_ratio": 0.0}
    del old["store_share"]
    assert upgrade(old)["memory_share"] == 0.2 and upgrade(new) == new
    for name, row, errors in (
        ("new", new, []),
        ("old", old, [{"sample": "x", "method": "h2o", "budget": 0.1, "error": "refused"}]),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.jsonl").write_text(json.dumps(row) + "\n")
        summary = {"model": "tiny", "errors": errors}
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    merged = run("report", tmp_path / "new", tmp_path / "old", "--out", tmp_path / "m", "--json")
    assert merged.exit_code == 0, merged.output
    summary = json.loads(merged.stdout)
    assert summary["config"]["memory_shares"] == [0.2]
    by = {c["method"]: c for c in summary["by_memory_share"]}
    assert by["h2o"]["memory_share"] == 0.2 and by["h2o"]["resident_share"] == 0.2
    assert by["sekv"]["resident_share"] == 0.18 and by["h2o"]["store_share"] == 0.0
    assert [c["rival"] for c in summary["goal"]["checks"]] == ["h2o@0.2"]
    assert "h2o@0.1: refused" in (tmp_path / "m" / "results.md").read_text()


def test_suite_names_unknown_methods_and_tasks(tmp_path):
    result = run("suite", "--methods", "full,nope", "--out", tmp_path)
    assert result.exit_code == 1
    assert result.stderr.strip().startswith("Error: unknown method 'nope'; choose from ")
    assert "full" in result.stderr
    result = run("suite", "--tasks", "needle,haiku", "--out", tmp_path)
    assert result.exit_code == 1 and "unknown task 'haiku'" in result.stderr
    assert run("suite", "--depths", "0.5,x").exit_code == 2  # usage error
    shared = run("suite", "--set", "memory_share=0.3", "--out", tmp_path)
    assert shared.exit_code == 1 and "--memory" in shared.stderr
    assert not (tmp_path / "results.jsonl").exists()


@pytest.mark.parametrize("command", ["suite", "fidelity", "needle", "qa", "ingest"])
def test_a_bad_setting_is_a_usage_error_naming_it(command, tmp_path):
    args = [] if command in ("suite", "fidelity", "needle") else [tmp_path / "doc.md"]
    bogus = run(command, *args, "--set", "bogus=1")
    assert bogus.exit_code == 2 and "bogus" in bogus.output and "--set" in bogus.output
    bad_value = run(command, *args, "--set", "store.segment.max_len=long")
    assert bad_value.exit_code == 2 and "store.segment.max_len" in bad_value.output
    assert run(command, *args, "--set", "neighbours").exit_code == 2  # not KEY=VALUE


def test_plain_bench_prints_help_and_the_subcommands_answer():
    plain = run()
    assert plain.exit_code == 0
    assert all(name in plain.stdout for name in ("suite", "fidelity", "needle", "qa", "ingest"))
    assert "report" in plain.stdout and "Usage" in plain.stdout
    suite = run("suite", "--help")
    assert suite.exit_code == 0
    assert all(o in suite.stdout for o in ("--memory", "--set", "--recall", "--router"))
    assert "--budgets" not in suite.stdout
    needle = run("needle", "--help")
    assert needle.exit_code == 0 and "--budget" in needle.stdout and "--memory" not in needle.stdout
    for gone in ("--near", "--kv-bits", "--summaries", "--span-tokens", "--neighbours"):
        assert gone not in suite.stdout + needle.stdout


def test_bench_offers_every_method_and_the_eviction_methods_prefill_once(
    tiny_model_dirs, tmp_path, monkeypatch
):
    """The suite hands its sessions one PrefillSlot: the eviction methods at every memory share
    prefill each sample once; sekv-training-free routes training-free."""
    from sekv_core.method_names import METHOD_NAMES
    from sekv_core.methods import eviction

    suite = run("suite", "--help")
    assert all(name in " ".join(suite.stdout.split()) for name in METHOD_NAMES)
    prefills = []
    real = eviction.prefill_with_mass

    def counted(loaded, ids, chunk, progress=None):
        prefills.append(len(ids))
        return real(loaded, ids, chunk, progress)

    monkeypatch.setattr(eviction, "prefill_with_mass", counted)
    out = tmp_path / "bench"
    result = run(
        "suite", "--methods", "streaming,h2o,sekv-training-free", "--tasks", "needle",
        "--lengths", "300", "--depths", "0.5", "--memory", "0.2,0.5", "--max-new-tokens", "2",
        "--model", tiny_model_dirs["llama"], "--out", out, "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and len(prefills) == 1  # 4 eviction sessions, one prefill
    assert {r["routing"]["router"] for r in rows if r["method"] == "sekv-training-free"} == {
        "training-free"
    }


def flat(output: str) -> str:
    """Terminal text on one line, without the error panel's frame."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", output).split())


def test_a_router_given_twice_or_to_no_method_that_uses_one_is_a_usage_error(tmp_path):
    missing = run("suite", "--router", "sketch")  # training-free: the method sekv-training-free
    assert missing.exit_code == 2 and "no router file at sketch" in flat(missing.output)
    router = tmp_path / "r.safetensors"
    router.write_bytes(b"")
    twice = run("suite", "--router", router, "--set", f"router={router}", "--out", tmp_path)
    assert twice.exit_code == 2 and "--router or --set router=" in flat(twice.output)
    unused = run("suite", "--methods", "full,sekv-training-free", "--router", router)
    assert unused.exit_code == 2 and "none of the methods uses a trained" in flat(unused.output)
    unused = run("fidelity", "--methods", "streaming", "--router", router)
    assert unused.exit_code == 2
