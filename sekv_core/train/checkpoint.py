"""A training run on disk: the router file (weights + manifest) and the optimizer state beside
it (``<file>.state``), written every few steps so that a run can be resumed."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..config import StoreSettings
from ..errors import SekvError
from ..models import LoadedModel
from ..router_files import load_router, save_router
from ..zoom.attention import NEIGHBOURS
from ..zoom.zoomnet import ZoomNet
from .settings import TrainSettings


def save(
    out: Path,
    net: ZoomNet,
    opt: torch.optim.Optimizer,
    loaded: LoadedModel,
    settings: TrainSettings,
    step: int,
    running: dict[str, float],
    metrics: dict[str, float],
    base: dict[str, float],
    chosen: int | None = None,
) -> None:
    """Write the router file and its optimizer state: ``step`` steps done, ``running`` losses,
    held-out ``metrics`` of the weights kept (``chosen``: the step they are from; None: this
    one), ``base`` the training-free start's."""
    names = {id(p): n for n, p in net.named_parameters()}
    optim = {}
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    optim[f"{names[id(p)]}/{key}"] = state[key].detach().cpu().contiguous()
            if "step" in state:
                optim[f"{names[id(p)]}/step"] = torch.as_tensor(state["step"]).reshape(1).float()
    base_params = sum(p.numel() for p in loaded.model.parameters())
    manifest = {
        "model": {"id": loaded.model_id, "fingerprint": loaded.fingerprint},
        "settings": {
            k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()
        },
        "step": step,
        "selected_step": step if chosen is None else chosen,
        "parameters": net.num_parameters(),
        "parameter_share": net.num_parameters() / base_params,
        "losses": {k: round(v, 5) for k, v in running.items()},
        "metrics": metrics,
        "training_free_metrics": base,
        "routing": trained_routing(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    save_router(out, net, manifest, optim)


def trained_routing() -> dict[str, Any]:
    """What training routed over (answering's defaults): span lengths and neighbours."""
    segment = StoreSettings().segment
    return {"span_tokens": [segment.min_len, segment.max_len], "neighbours": NEIGHBOURS}


def resume(
    out: Path,
    net: ZoomNet,
    opt: torch.optim.Optimizer,
    loaded: LoadedModel,
    settings: TrainSettings,
    log: Callable[[str], None],
) -> tuple[int, dict[str, Any]]:
    """Continue from ``out`` when it holds a compatible run (weights + optimizer state).

    Returns the step reached and the run's manifest ({} for a new run); a finished run's file
    holds the weights it kept, with their held-out metrics."""
    state_file = out.with_name(out.name + ".state")
    if not out.exists():
        return 0, {}
    router = load_router(out, loaded.fingerprint, loaded.model_id)
    if router.manifest["shape"]["dim"] != settings.dim:
        raise SekvError(
            f"{out} was trained with a {router.manifest['shape']['dim']}-dim routing space, "
            f"not {settings.dim}; use another --out or the same settings"
        )
    net.load_state_dict(router.net.state_dict())
    net.requires_grad_(True)
    if state_file.exists():
        saved = load_file(str(state_file))
        for name, p in net.named_parameters():
            if f"{name}/exp_avg" in saved:
                opt.state[p] = {
                    "step": saved[f"{name}/step"][0].clone(),
                    "exp_avg": saved[f"{name}/exp_avg"].to(p.device),
                    "exp_avg_sq": saved[f"{name}/exp_avg_sq"].to(p.device),
                }
    step = int(router.manifest.get("step", 0))
    log(f"resuming from {out} at step {step}")
    return step, router.manifest
