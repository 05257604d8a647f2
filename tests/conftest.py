"""Shared fixtures: tiny random models built in code (no download) and the real default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TQDM_DISABLE", "1")

CORPUS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Question: what is the name of the keeper? Answer: the keeper is named Orla.",
    "Document pages hold numbers like 1987, 2024 and 42, dates such as 4 March.",
    "Budget, staff, policy, security, office, handbook, lighthouse, island, report.",
] * 20
TINY = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=1, hidden_size=64),
}


def build_tokenizer(out: Path):
    from sekv_bench.random_model import byte_bpe

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    return byte_bpe(out, CORPUS, 400, specials, pad="<|im_end|>", unk="<unk>")


def build_tiny_model(out: Path, family: str, window: int = 2048, **shape) -> Path:
    """A 2-layer random model of ``family`` with a real BPE tokenizer, saved to ``out``
    (``shape``: other head counts and sizes than ``TINY``'s)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(out)
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[family]
    config = config_cls(
        vocab_size=len(tokenizer),
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=window,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        **(shape or TINY[family]),
    )
    torch.manual_seed(0)
    model_cls(config).save_pretrained(out)
    return out


def build_tiny_gguf(model_dir: Path, out: Path) -> Path:
    """The tiny qwen2 model in ``model_dir`` written as ``out`` (a GGUF file, as llama.cpp
    writes one): its matrices in Q8_0, its output tied to the embedding (none stored), its
    tokenizer's vocabulary, merges and chat template as metadata."""
    import json

    import gguf
    from gguf.quants import quantize
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = Qwen2ForCausalLM.from_pretrained(model_dir)
    c = model.config
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), "qwen2")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    vocab = sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(vocab)
    control = set(tokenizer.all_special_tokens)
    writer.add_token_types([3 if token in control else 1 for token in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_chat_template(tokenizer.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, c.num_hidden_layers)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied: llama.cpp stores no output matrix
            continue
        array = tensor.float().numpy()
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if array.ndim == 2:
            writer.add_tensor(gguf_name, quantize(array, q8), raw_dtype=q8)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


QWEN_GROUPS = dict(num_attention_heads=14, num_key_value_heads=2, hidden_size=224)
"""Qwen2.5-0.5B's heads (7 query heads per KV head), at a head size of 16."""


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """A folder holding one GGUF file: a tiny qwen2 with Qwen2.5-0.5B's head groups, as a
    quantised GGUF model."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    model = build_tiny_model(root / "hf", "qwen2", **QWEN_GROUPS)
    build_tiny_gguf(model, root / "gguf" / "tiny-qwen2.Q8_0.gguf")
    return root / "gguf"


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {fam: build_tiny_model(root / fam, fam) for fam in TINY}


@pytest.fixture(params=sorted(TINY))
def tiny_loaded(request, tiny_model_dirs):
    from sekv_core.models import load_model

    return load_model(str(tiny_model_dirs[request.param]), device="cpu")


@pytest.fixture(autouse=True)
def sekv_home(tmp_path, monkeypatch) -> Path:
    """Each test gets its own $SEKV_HOME (the default model's converted copy is shared)."""
    home = tmp_path / "sekv-home"
    monkeypatch.setenv("SEKV_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def shared_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sekv-shared-home")


@pytest.fixture(scope="session")
def default_model(shared_home):
    """The real embedded default model, loaded once per test session."""
    from sekv_core.models import load_model

    old = os.environ.get("SEKV_HOME")
    os.environ["SEKV_HOME"] = str(shared_home)
    try:
        return load_model(None, device="cpu")
    finally:
        if old is None:
            os.environ.pop("SEKV_HOME", None)
        else:
            os.environ["SEKV_HOME"] = old


def home_files(home: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``home`` (itself too) with its size and mtime: what a write changes."""
    out = {}
    for path in [home, *home.rglob("*")]:
        st = path.lstat()
        out[str(path.relative_to(home))] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture
def read_only_home(sekv_home, monkeypatch):
    """Call it once $SEKV_HOME holds what the test needs: it makes the home read-only and
    returns :func:`home_files` of it. ``chmod -R a-w``; where the tests run as root, who
    writes anyway, ``os.access`` (what :func:`sekv_core.paths.read_only` asks) also says no
    to writing there, so the test still sees whether sekv writes."""
    paths: list[Path] = []

    def make() -> dict[str, tuple[int, int]]:
        paths.extend(p for p in [sekv_home, *sekv_home.rglob("*")] if not p.is_symlink())
        for path in paths:
            path.chmod(path.stat().st_mode & ~0o222)
        if os.geteuid() == 0:
            real = os.access

            def access(path, mode, *args, **kwargs):
                inside = Path(os.path.abspath(path)).is_relative_to(sekv_home)
                return False if inside and mode & os.W_OK else real(path, mode, *args, **kwargs)

            monkeypatch.setattr(os, "access", access)
        return home_files(sekv_home)

    yield make
    for path in paths:
        if path.exists():  # (a -wal or -shm goes with its last connection)
            path.chmod(path.stat().st_mode | 0o200)
