"""Hugging Face hub ids for ``--model``: the local cache first, the network only when allowed
and reachable (one short request, no retries), and one actionable line when neither has it."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import SekvError, one_line

HUB_PROBE_SECONDS = 3.0  # one metadata request says whether the hub is reachable (no retries)
PASS_A_MODEL = (
    "pass a model directory (config.json, weights, tokenizer), a .gguf file or a cached hub id"
)


def hub_offline() -> bool:
    """Whether the hub is off limits (read now: huggingface_hub reads it once, at import)."""
    flags = (os.environ.get(v, "") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(f.strip().lower() in ("1", "true", "yes", "on") for f in flags)


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot of hub model ``repo_id``: the cached one, else downloaded when the hub
    is allowed and reachable; otherwise a SekvError at once saying how to get it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except HFValidationError:
        raise SekvError(
            f"--model {repo_id!r} is neither a directory nor a hub id; {PASS_A_MODEL}"
        ) from None
    except LocalEntryNotFoundError:  # not cached, or only partly
        pass
    if hub_offline():
        raise SekvError(_uncached(repo_id, "HF_HUB_OFFLINE is set, so nothing is downloaded"))
    return download(repo_id, hub_files(repo_id))


def hub_files(repo_id: str) -> list[str]:
    """The files of ``repo_id`` on the hub (one quick request: an unreachable hub fails fast
    here instead of in retries with backoff)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        info = HfApi().model_info(repo_id, timeout=HUB_PROBE_SECONDS)
    except RepositoryNotFoundError:  # also gated or private without a token
        raise SekvError(
            f"--model {repo_id!r}: no such model on the Hugging Face hub, or it is private or "
            f"gated (log in with `hf auth login`); check the id, or {PASS_A_MODEL}"
        ) from None
    except Exception as exc:  # connection refused, DNS, timeout, proxy, hub down
        hub = f"the hub cannot be reached ({one_line(exc)})"
        raise SekvError(_uncached(repo_id, hub)) from None
    return [s.rfilename for s in info.siblings or []]


def download(repo_id: str, files: list[str]) -> Path:
    """Download what loading ``repo_id`` needs (configs, tokenizer, one weight format)."""
    from huggingface_hub import snapshot_download

    weights = "*.safetensors" if any(f.endswith(".safetensors") for f in files) else "*.bin"
    patterns = ["*.json", "*.txt", "tokenizer.model", weights]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:  # network errors mid-way, disk full, permissions
        raise SekvError(
            f"--model {repo_id!r}: the download failed ({one_line(exc)}); retry, or {PASS_A_MODEL}"
        ) from None


def _uncached(repo_id: str, why: str) -> str:
    from huggingface_hub import constants

    tip = "" if hub_offline() else "; HF_HUB_OFFLINE=1 makes hub lookups local-only (no wait)"
    return (
        f"--model {repo_id!r} not found: not a local directory and not in the Hugging Face "
        f"cache ({constants.HF_HUB_CACHE}), and {why}; download it where there is network "
        f"(`hf download {repo_id}`) and copy that cache here (or point HF_HOME at it), or "
        f"pass a local model directory{tip}"
    )
