"""`--model` failures: one `Error:` line saying what is wrong and what to pass, exit 1, no
traceback; hub ids are looked up in the local cache first and fail at once when absent."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from safetensors.torch import save_file
from typer.testing import CliRunner

from sekv_cli.main import app

runner = CliRunner()
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
UNCACHED = "someorg/some-model-sekv-test"


def ask(tmp_path: Path, model: str | Path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The keeper of the lighthouse is named Orla.")
    return runner.invoke(app, ["ask", str(doc), "Who is the keeper?", "--model", str(model)])


def one_error_line(result) -> str:
    """The single `Error:` line a failed command printed (asserting the contract)."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: --model "), result.stderr
    return lines[0]


def copy_model(src: Path, dst: Path, drop: tuple[str, ...] = ()) -> Path:
    shutil.copytree(src, dst, ignore=lambda _, names: [n for n in names if n in drop])
    return dst


def truncated(d: Path) -> None:
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def garbage(d: Path) -> None:
    (d / "model.safetensors").write_bytes(b"\xff" * 4096)


def no_tensors(d: Path) -> None:  # a readable file that holds none of the config's tensors
    save_file({}, str(d / "model.safetensors"))


def other_weights(d: Path) -> None:  # another model's weights: same names, other shapes
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))


def set_config(**values):
    def edit(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, **values}))

    return edit


def drop_config_key(key: str):
    def edit(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        config.pop(key)
        (d / "config.json").write_text(json.dumps(config))

    return edit


# name -> (files removed from a copy of the tiny llama, an edit of the copy, what the error says)
BROKEN = {
    "no-weights": (("model.safetensors",), None, "config.json but no weights"),
    "no-tokenizer": (TOKENIZER, None, "has no tokenizer"),
    "truncated-weights": ((), truncated, "cannot read its weights"),
    "garbage-weights": ((), garbage, "cannot read its weights"),
    "weights-without-tensors": ((), no_tensors, "weights do not fit its config"),
    "mis-shaped-weights": ((), other_weights, "weights do not fit its config"),
    "unsupported-family": ((), set_config(model_type="gpt2"), "'gpt2' model; sekv supports"),
    "unknown-family": ((), set_config(model_type="frobnet"), "'frobnet' model; sekv supports"),
    "no-model-type": ((), drop_config_key("model_type"), "names no model_type"),
    "config-not-json": ((), lambda d: (d / "config.json").write_text("{oops"), "not valid JSON"),
    "config-a-list": ((), lambda d: (d / "config.json").write_text("[]"), "names no model_type"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_model_directory_is_one_error_line(name, tmp_path, tiny_model_dirs):
    drop, edit, says = BROKEN[name]
    model = copy_model(tiny_model_dirs["llama"], tmp_path / name, drop)
    if edit is not None:
        edit(model)
    line = one_error_line(ask(tmp_path, model))
    assert says in line and str(model) in line, line
    assert "pass" in line or "copy" in line  # says what to do


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("/etc", "is not a model directory: /etc has no config.json"),
        ("{empty}", "has no config.json"),
        ("{file}", "is a file; pass the directory"),
        ("./no/such/dir", "no such directory"),
        ("bad id with spaces", "neither a directory nor a hub id"),
    ],
)
def test_not_a_model_is_one_error_line(model, says, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    model = model.format(empty=tmp_path / "empty", file=tmp_path / "file")
    line = one_error_line(ask(tmp_path, model))
    assert says in line, line
    assert "pass" in line


def test_uncached_hub_id_offline_fails_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    line = one_error_line(ask(tmp_path, UNCACHED))
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, elapsed
    assert f"--model '{UNCACHED}' not found" in line and "HF_HUB_OFFLINE is set" in line
    assert f"`hf download {UNCACHED}`" in line


def test_uncached_hub_id_without_offline_fails_fast(tmp_path, monkeypatch):
    """No HF_HUB_OFFLINE: one quick request to the hub decides (no retries with backoff); here
    the hub is unreachable, elsewhere it answers that the id does not exist."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    start = time.perf_counter()
    line = one_error_line(ask(tmp_path, UNCACHED))
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, elapsed
    assert "hub cannot be reached" in line or "no such model on the Hugging Face hub" in line
    if "cannot be reached" in line:
        assert f"`hf download {UNCACHED}`" in line and "HF_HUB_OFFLINE=1" in line


def fake_cache(root: Path, repo_id: str, model: Path) -> Path:
    """A Hugging Face cache holding ``model`` as ``repo_id``'s snapshot of main."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(model, repo / "snapshots" / commit)
    return repo / "snapshots" / commit


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    from huggingface_hub import constants

    root = tmp_path / "hf-cache"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def test_cached_hub_id_loads_from_the_cache(tmp_path, tiny_model_dirs, hub_cache):
    from sekv_core.models import load_model

    fake_cache(hub_cache, "someorg/tiny", tiny_model_dirs["llama"])
    loaded = load_model("someorg/tiny", device="cpu")
    assert loaded.model_id == "someorg/tiny" and loaded.spec.family == "llama"
    assert [p.name for p in loaded.weight_files] == ["model.safetensors"]


def test_a_broken_cached_hub_id_is_one_error_line(tmp_path, tiny_model_dirs, hub_cache):
    snapshot = fake_cache(hub_cache, "someorg/tiny", tiny_model_dirs["llama"])
    truncated(snapshot)
    line = one_error_line(ask(tmp_path, "someorg/tiny"))
    assert "--model 'someorg/tiny': cannot read its weights" in line
