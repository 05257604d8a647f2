"""Teacher-forced decoding and `sekv bench fidelity` (agreement with full KV along its answers)."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from sekv_bench.fidelity import compare
from sekv_cli.main import app
from sekv_core.decode import Forcing
from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.methods import MethodSettings


def test_forcing_a_methods_own_answer_reproduces_its_distributions(tiny_loaded, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(f"Room {i} keeps item {i * 7 % 31}." for i in range(40)))
    session = Session(tiny_loaded, load_document(doc), "full", MethodSettings())
    free = Forcing()
    answer = session.ask("Which room keeps item 12?", 6, forcing=free)
    ids = [int(lp.argmax()) for lp in free.logprobs]
    assert len(free.logprobs) in (answer.tokens_generated, answer.tokens_generated + 1)  # + stop
    teacher = Forcing(ids)
    session.ask("Which room keeps item 12?", 6, forcing=teacher)
    assert len(teacher.logprobs) == len(ids)
    got = compare(torch.stack(free.logprobs), torch.stack(teacher.logprobs), ids)
    assert got["agree"] == len(ids) and got["first_miss"] is None and got["kl_sum"] < 1e-4
    # a different forced answer is fed as given: the recorded steps follow it, not the argmax
    other = [(t + 1) % tiny_loaded.model.config.vocab_size for t in ids[:3]]
    f = Forcing(other)
    session.ask("Which room keeps item 12?", 6, forcing=f)
    assert len(f.logprobs) == 3
    assert torch.allclose(f.logprobs[0], free.logprobs[0], atol=1e-5)  # same first step
    assert not torch.allclose(f.logprobs[1], free.logprobs[1], atol=1e-3)  # then it diverges


def test_compare_counts_agreement_and_kl():
    ref = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]]), -1)
    same = compare(ref, ref, [0, 1])
    assert same == {"tokens": 2, "agree": 2, "kl_sum": 0.0, "first_miss": None}
    flipped = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [3.0, 0.0, 0.0]]), -1)
    got = compare(ref, flipped, [0, 1])
    assert got["agree"] == 1 and got["first_miss"] == 1 and got["kl_sum"] > 1.0


def test_fidelity_bench_end_to_end_through_the_cli(tiny_model_dirs, tmp_path):
    out = tmp_path / "fid"
    result = CliRunner().invoke(
        app,
        [
            "bench", "fidelity", "--methods", "sekv,streaming", "--tasks", "needle",
            "--lengths", "300", "--depths", "0.5", "--memory", "0.1,1.0",
            "--answer-tokens", "4", "--model", str(tiny_model_dirs["llama"]),
            "--out", str(out), "--json",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {(r["method"], r["memory_share"]) for r in rows} == {
        ("sekv", 0.1), ("sekv", 1.0), ("streaming", 0.1), ("streaming", 1.0),
    }  # fmt: skip
    by = {(c["method"], c["memory_share"]): c for c in summary["configs"]}
    # a window of the whole document is full KV; a 10% window forgets most of it
    assert by["streaming", 1.0]["top1_agreement"] == 1.0
    assert by["streaming", 1.0]["kl_per_token"] < 1e-5 < by["streaming", 0.1]["kl_per_token"]
    assert all(0 < r["resident_share"] for r in rows)
    assert "| sekv | 0.10 |" in (out / "fidelity.md").read_text()
    refused = CliRunner().invoke(
        app, ["bench", "fidelity", "--methods", "full", "--model", str(tiny_model_dirs["llama"])]
    )
    assert refused.exit_code == 1 and "reference" in refused.output


def test_every_span_zoomed_follows_full_kv_as_closely_as_the_store_allows(
    tiny_model_dirs, tmp_path
):
    """--every-span: no memory target, every span zoomed; a lossless store (16-bit codes)
    follows full KV up to the 8-bit rounding of its rows, a coarse one (keys on the coarsest
    even grid) does not (--set reaches the store's settings); the summary reports the store's
    size beside the fidelity."""

    def run(key: str, value: str, spans: tuple[int, int] = (8, 32)) -> dict:
        low, high = spans
        result = CliRunner().invoke(
            app,
            [
                "bench", "fidelity", "--methods", "sekv", "--tasks", "needle", "--lengths",
                "300", "--depths", "0.5", "--answer-tokens", "4", "--every-span",
                "--set", f"store.key_code={key}", "--set", f"store.value_code={value}",
                "--set", f"store.segment.min_len={low}", "--set", f"store.segment.max_len={high}",
                "--model", str(tiny_model_dirs["llama"]),
                "--out", str(tmp_path / f"{key.replace('*', 'r')}-{low}-{high}"), "--json",
            ],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        summary = json.loads(result.stdout)
        store = summary["settings"]["store"]
        assert (store["segment"]["min_len"], store["segment"]["max_len"]) == (low, high)
        assert (store["key_code"], store["value_code"]) == (key, value) and summary["every_span"]
        assert summary["settings"]["margin"] >= 1e9  # no span left out for scoring low
        (config,) = summary["configs"]
        assert config["memory_share"] is None
        return config

    lossless, coarse = run("*x16", "*x16"), run("even:4", "*x4")
    assert run("*x16", "*x16", (2, 4))["top1_agreement"] == 1.0  # short spans: still lossless
    assert lossless["top1_agreement"] == 1.0 and lossless["kl_per_token"] < 1e-3
    assert coarse["kl_per_token"] > lossless["kl_per_token"]  # (the tiny model: both small)
    # the store's size beside its fidelity: coarse rows cost less disk than 16-bit ones
    assert 0 < coarse["store_share"] < lossless["store_share"]
    assert coarse["reconstruct_us"] > 0 and lossless["reconstruct_us"] > 0
