"""Block retrieval (Quest / InfLLM-like): fixed blocks, a resident bound per block, top-k loading.

The context after the sinks is cut into fixed blocks of ``block_size`` (16) tokens. Resident on
the device: the sinks' K/V and, per (layer, KV head, block), the channel-wise min and max of the
block's keys (Quest's representative). The blocks' full-resolution K/V (the model's post-RoPE
keys, fp16) live in the offload tier: a memory-mapped safetensors file under
``$SEKV_HOME/stores/blocks-…``, built atomically and verified like the span store.

At every attention call each KV head scores every block with the Quest bound

    u_b = max over the group's queries of  sum_d max(q_d min_bd, q_d max_bd)  >=  q . k  (k in b)

loads its top ``budget // block_size`` blocks (only those not already loaded for that layer are
read from disk) and attends, in one softmax, over sinks + loaded blocks + the local window.
With a budget covering every block this is exactly full attention (at fp16 K/V).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from ..backend import use_attention
from ..config import DEFAULT_BUDGET, BlockSettings
from ..decode import Forcing, PositionedStep, decode_tokens
from ..errors import SekvError
from ..kvquant import STORE_DTYPE, resident_dtype
from ..models import LoadedModel
from ..paths import sekv_home
from ..prompt import Context, stop_ids
from ..sampling import Sampling
from ..store.format import DIGEST, manifest_digest, sha256, store_key
from ..store.load import StoreInvalid
from ..store.tensorfile import map_tensors, read_tensors
from ..store.write import write_atomically
from ..zoom.attention import mixed_attention
from ..zoom.router import Router
from .base import Method, Progress
from .full import prefill_cache

NAME = "sekv-blocks"
FORMAT, FORMAT_VERSION = "sekv-block-store", 1
FILES = ("resident.safetensors", "blocks.safetensors")


class BlockMemory:
    """A block store on the device: sinks, Quest bounds, and the blocks each layer loaded."""

    def __init__(self, path: Path, manifest: dict, device: torch.device, dtype: torch.dtype):
        shape = manifest["shape"]
        L, H, B, S, D = (shape[k] for k in ("layers", "heads", "blocks", "block_size", "head_dim"))
        resident = read_tensors(path / "resident.safetensors")
        keep = resident_dtype(dtype)  # as SeKV's resident tier
        self.sink_k, self.sink_v, self.block_min, self.block_max = (
            resident[n].to(device=device, dtype=keep)
            for n in ("sink_k", "sink_v", "block_min", "block_max")
        )  # (L, H, F, D) x2, (L, H, B, D) x2
        self.blocks = map_tensors(path / "blocks.safetensors")["kv"].view(L, H, B, 2, S, D)
        self.num_layers, self.num_kv_heads, self.n_blocks, self.block_size = L, H, B, S
        self.head_dim, self.block_tokens = D, int(shape["block_tokens"])
        self.device, self.dtype = device, dtype
        self.clear()

    def resident_bytes(self) -> int:
        tensors = (self.sink_k, self.sink_v, self.block_min, self.block_max)
        return sum(t.numel() * t.element_size() for t in tensors)

    def representative_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.block_min, self.block_max))

    def clear(self) -> None:
        """Forget loaded blocks (between questions)."""
        self.loaded: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.num_layers
        self.blocks_read = 0
        self.peak_loaded_bytes = 0  # every layer's loaded blocks at fp16, at their largest
        self.peak_live_bytes = 0  # + one call's entries copied to the model dtype

    def load(self, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """K, V (H, k*S, D) of the blocks ``ids`` (H, k) picked per head, and a bias (H, k*S).

        Blocks this layer already holds are reused; the others are read from the offload tier in
        one gather. The bias is -inf on the padding of the last, partial block.
        """
        H, k, S, D = *ids.shape, self.block_size, self.head_dim
        host = ids.cpu()  # host: which reads
        last = self.loaded[layer]
        if last is not None and torch.equal(last[0], host):  # same picks as this layer's last call
            kv = last[1]
        else:
            kv = self._gather(layer, host, last)
            self.loaded[layer] = (host, kv)
        token = ids[..., None] * S + torch.arange(S, device=ids.device)  # (H, k, S)
        bias = torch.where(token < self.block_tokens, 0.0, torch.finfo(torch.float32).min)
        loaded = sum(x[1].numel() for x in self.loaded if x is not None) * STORE_DTYPE.itemsize
        live = H * (self.sink_k.shape[2] + k * S) * 2 * D * self.dtype.itemsize
        self.peak_loaded_bytes = max(self.peak_loaded_bytes, loaded)
        self.peak_live_bytes = max(self.peak_live_bytes, loaded + live)
        return kv[:, :, 0].reshape(H, k * S, D), kv[:, :, 1].reshape(H, k * S, D), bias.flatten(1)

    def _gather(
        self, layer: int, ids: torch.Tensor, last: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        """(H, k, 2, S, D) K/V of blocks ``ids`` (H, k): held ones copied, the rest read."""
        H, k = ids.shape
        kv = torch.empty(
            H, k, 2, self.block_size, self.head_dim, dtype=STORE_DTYPE, device=self.device
        )
        fresh = torch.ones(H, k, dtype=torch.bool)
        if last is not None:
            match = ids[:, :, None] == last[0][:, None, :]  # (H, k, k_old)
            fresh = ~match.any(dim=-1)
            held = torch.nonzero(~fresh, as_tuple=True)
            kv[held] = last[1][held[0], match[held].float().argmax(dim=-1)]
        h, j = torch.nonzero(fresh, as_tuple=True)
        if len(h):
            kv[h, j] = self.blocks[layer, h, ids[h, j]].to(self.device, non_blocking=True)
        self.blocks_read += len(h)
        return kv


class QuestRouter:
    """Quest's bound: per block, sum_d max(q_d min_d, q_d max_d), the most any key can score."""

    name = "quest"

    def scores(
        self, memory: BlockMemory, layer: int, q: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """q: (H_kv, G, Tq, D) -> (H_kv, B) upper bound of each block's logits (scaled)."""
        lo, hi = (t[layer].to(q.dtype) for t in (memory.block_min, memory.block_max))
        bound = torch.einsum("hgtd,hbd->hgtb", q.clamp(min=0), hi) + torch.einsum(
            "hgtd,hbd->hgtb", q.clamp(max=0), lo
        )  # (H, G, Tq, B)
        return bound.amax(dim=(1, 2)) * scaling


@dataclass
class BlockPolicy:
    """How one answer retrieves: the router and the blocks loaded per (layer, KV head)."""

    router: Router
    blocks: int


def block_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    block_memory: BlockMemory | None = None,
    block_policy: BlockPolicy | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query (1, Hq, Tq, D), key/value (1, Hkv, Tl, D) local."""
    if block_memory is None or block_policy is None:
        raise RuntimeError("block attention called without block_memory / block_policy")
    memory, layer = block_memory, module.layer_idx
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    _, Hq, Tq, D = query.shape
    Hkv = key.shape[1]
    q = query[0].view(Hkv, Hq // Hkv, Tq, D)  # (Hkv, G, Tq, D)
    scores = block_policy.router.scores(memory, layer, q, scaling)  # (Hkv, B)
    ids = scores.topk(min(block_policy.blocks, memory.n_blocks), dim=1).indices  # (Hkv, k)
    k_blocks, v_blocks, bias = memory.load(layer, ids)
    sink_k, sink_v = memory.sink_k[layer], memory.sink_v[layer]  # (Hkv, F, D)
    k_mem = torch.cat([sink_k, k_blocks], dim=1).to(q.dtype)
    v_mem = torch.cat([sink_v, v_blocks], dim=1).to(q.dtype)
    bias = torch.cat([bias.new_zeros(Hkv, sink_k.shape[1]), bias], dim=1)
    out, _ = mixed_attention(q, key[0], value[0], k_mem, v_mem, bias, scaling)
    return out.reshape(Hq, Tq, D).transpose(0, 1)[None].contiguous(), None  # (1, Tq, Hq, D)


class BlockRetrieval(Method):
    name = "blocks"

    memory_store: BlockMemory
    path: Path
    cache_hit: bool = False
    policy: BlockPolicy | None = None

    def prepare(self, progress: Progress | None = None) -> None:
        settings = self.settings.blocks
        key = store_key(self.loaded, self.document, self.context, settings)
        self.path = sekv_home() / "stores" / f"blocks-{key}"
        manifest = None
        if self.path.exists():
            try:
                manifest = verify(self.path, self.loaded, self.document.sha256, settings)
                self.cache_hit = True
            except StoreInvalid as exc:
                if self.settings.warn:
                    self.settings.warn(f"rebuilding the block store at {self.path}: {exc}")
        if manifest is None:
            try:
                build(
                    self.path, self.loaded, self.document.sha256, self.context, settings, progress
                )
            except OSError as exc:
                raise SekvError(
                    f"cannot write the block store under {self.path.parent} "
                    f"({exc.strerror or exc}); set SEKV_HOME to a writable directory"
                ) from None
            manifest = verify(self.path, self.loaded, self.document.sha256, settings)
        self.memory_store = BlockMemory(self.path, manifest, self.loaded.device, self.loaded.dtype)

    def budget(self) -> int:
        """Tokens loaded per (layer, KV head): what ``memory_share`` leaves, else ``budget``.

        Under a memory target the resident tier (sinks + representatives) is paid first; the
        rest buys loaded tokens at their fp16 K/V cost in every layer and head. At least one
        block is always loaded (a target below the resident tier is reported as measured).
        """
        s, mem = self.settings, self.memory_store
        if s.memory_share is None:
            return s.budget or DEFAULT_BUDGET
        spec = self.loaded.spec
        target = s.memory_share * spec.kv_bytes(len(self.context), 2)
        tokens = int((target - mem.resident_bytes()) // spec.kv_bytes(1, 2))
        return max(mem.block_size, tokens)

    def generate(
        self,
        question_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling | None = None,
        forcing: Forcing | None = None,
    ) -> Iterator[int]:
        model, device, memory = self.loaded.model, self.loaded.device, self.memory_store
        self.policy = policy = BlockPolicy(QuestRouter(), self.budget() // memory.block_size)
        memory.clear()
        local = DynamicCache(config=model.config)
        start = len(self.context)  # local tokens continue after the document's positions
        self.step = step = PositionedStep(
            model, local, start, device, block_memory=memory, block_policy=policy
        )

        with use_attention(model, NAME, block_attention_forward):
            stop = stop_ids(self.loaded.tokenizer)
            yield from decode_tokens(step, question_ids, stop, max_new_tokens, sampling, forcing)

    def memory(self) -> dict[str, int]:
        mem = self.memory_store
        resident = mem.resident_bytes()
        return {
            "resident_bytes": resident + mem.peak_loaded_bytes,
            "resident_tier_bytes": resident,
            "representative_bytes": mem.representative_bytes(),
            "loaded_peak_bytes": mem.peak_loaded_bytes,
            "local_window_bytes": self.loaded.spec.kv_bytes(self.local_tokens, 2),
            "offloaded_bytes": mem.blocks.numel() * mem.blocks.element_size(),
        }

    def routing(self) -> dict[str, Any]:
        if self.policy is None:
            return {}
        mem = self.memory_store
        return {
            "router": self.policy.router.name,
            "budget": self.policy.blocks * mem.block_size,
            "block_size": mem.block_size,
            "blocks": mem.n_blocks,
            "blocks_per_head": min(self.policy.blocks, mem.n_blocks),
            "blocks_read": mem.blocks_read,
        }

    def store_info(self) -> dict[str, Any]:
        return {"path": str(self.path), "cache_hit": self.cache_hit}


def build(
    path: Path,
    loaded: LoadedModel,
    doc_sha256: str,
    context: Context,
    settings: BlockSettings,
    progress: Progress | None = None,
) -> None:
    """Prefill the context, cut it into sinks + fixed blocks, write the store atomically."""
    t0 = time.perf_counter()
    cache = prefill_cache(loaded.model, context.ids, settings.prefill_chunk, progress)
    keys = torch.stack([layer.keys[0] for layer in cache.layers]).cpu().to(STORE_DTYPE)
    values = torch.stack([layer.values[0] for layer in cache.layers]).cpu().to(STORE_DTYPE)
    L, H, T, D = keys.shape  # post-RoPE keys at their original positions
    F, S = min(T, context.doc_start + settings.sinks), settings.block_size
    n = T - F  # block tokens
    B = -(-n // S)
    pad = B * S - n
    kv = torch.stack([keys[:, :, F:], values[:, :, F:]], dim=2)  # (L, H, 2, n, D)
    kv = torch.nn.functional.pad(kv, (0, 0, 0, pad)).view(L, H, 2, B, S, D).transpose(2, 3)
    valid = (torch.arange(B * S) < n).view(B, S, 1)
    block_k = kv[:, :, :, 0].float()  # (L, H, B, S, D); bounds of the stored (fp16) keys
    block_min = torch.where(valid, block_k, float("inf")).amin(dim=3)
    block_max = torch.where(valid, block_k, float("-inf")).amax(dim=3)
    resident = {
        "sink_k": keys[:, :, :F],
        "sink_v": values[:, :, :F],
        "block_min": block_min.to(STORE_DTYPE),
        "block_max": block_max.to(STORE_DTYPE),
    }
    spec = loaded.spec
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": {"id": loaded.model_id, "fingerprint": loaded.fingerprint},
        "settings": settings.to_dict(),
        "document": {"sha256": doc_sha256, "context_tokens": T, "doc_start": context.doc_start},
        "shape": {
            "layers": L,
            "heads": H,
            "blocks": B,
            "block_size": S,
            "head_dim": D,
            "sinks": F,
            "block_tokens": n,
        },
        "bytes": {
            "resident": sum(t.numel() * t.element_size() for t in resident.values()),
            "offloaded": kv.numel() * kv.element_size(),
            "full_kv_fp16": spec.kv_bytes(T, 2),
        },
        "timings": {"build_s": round(time.perf_counter() - t0, 4)},
    }
    files = {"resident.safetensors": resident, "blocks.safetensors": {"kv": kv.flatten()}}
    write_atomically(path, files, manifest)


def verify(path: Path, loaded: LoadedModel, doc_sha256: str, settings: BlockSettings) -> dict:
    """The manifest of a block store fit for this model, document and settings; else
    :class:`StoreInvalid` saying why (wrong format/model/document/settings, corrupt file)."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise StoreInvalid(f"manifest unreadable ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get(DIGEST) != manifest_digest(manifest):
        raise StoreInvalid("manifest digest mismatch (edited or corrupt)")
    expect = {
        "format": (manifest.get("format"), FORMAT),
        "version": (manifest.get("version"), FORMAT_VERSION),
        "model": (manifest.get("model", {}).get("fingerprint"), loaded.fingerprint),
        "document": (manifest.get("document", {}).get("sha256"), doc_sha256),
        "settings": (manifest.get("settings"), settings.to_dict()),
    }
    for what, (found, want) in expect.items():
        if found != want:
            raise StoreInvalid(f"{what} is {found!r}, expected {want!r}")
    for name in FILES:
        meta, file = manifest.get("files", {}).get(name, {}), path / name
        if not file.is_file() or file.stat().st_size != meta.get("bytes"):
            raise StoreInvalid(f"{name} missing or truncated")
        if sha256(file) != meta.get("sha256"):
            raise StoreInvalid(f"{name} checksum mismatch (corrupt)")
    return manifest
