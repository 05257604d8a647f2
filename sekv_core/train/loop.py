"""`sekv train`: the optimisation loop, with held-out model selection and resumable checkpoints.

Examples (:mod:`~sekv_core.train.examples`) are visited in a seeded shuffled order, one per
optimizer step; each step draws a zoom budget and minimises :func:`~sekv_core.train.losses.losses`.
Every ``eval_every`` steps the router is evaluated on held-out documents, and the router file
keeps the weights with the lowest held-out KL to the teacher — the untrained start (the
training-free rule) included, so training never ends worse than it began.
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import SekvError
from ..models import LoadedModel
from ..router_files import load_router
from ..zoom.zoomnet import NetShape, ZoomNet
from .checkpoint import resume, save
from .evaluate import evaluate, held_out_score
from .examples import Log, prepare
from .losses import losses
from .settings import TrainSettings


def train(
    loaded: LoadedModel,
    out: Path,
    settings: TrainSettings,
    log: Log = print,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Train (or resume) the zoom router for ``loaded``; write it to ``out``. Returns metrics."""
    torch.manual_seed(settings.seed)
    spec = loaded.spec
    config = loaded.model.config
    shape = NetShape(
        spec.num_layers,
        config.num_attention_heads,
        spec.num_kv_heads,
        spec.head_dim,
        settings.dim,
    )
    net = ZoomNet(shape).to(loaded.device)
    opt = torch.optim.Adam(net.parameters(), lr=settings.lr)
    start, resumed = resume(out, net, opt, loaded, settings, log)
    if start >= settings.steps:
        log(f"{out} already holds {start} steps (>= --steps {settings.steps}); nothing to do")
        manifest = load_router(out).manifest
        return {
            "parameters": net.num_parameters(),
            **manifest.get("metrics", {}),
            "training_free": manifest.get("training_free_metrics", {}),
        }
    loaded.model.requires_grad_(False)
    docs, examples, held = prepare(loaded, settings, log)
    if not examples:
        raise SekvError("no training examples were generated; raise --docs")
    untrained = ZoomNet(shape).to(loaded.device)
    base = evaluate(loaded, untrained, docs, held, settings)
    log(f"training-free start (held out): {base}")
    # model selection on the held-out documents: the training-free start is a candidate too,
    # and so are the weights a finished run kept (they are what a resumed run starts from)
    best = (held_out_score(base), 0, untrained.state_dict(), base)
    if resumed.get("metrics") and held_out_score(resumed["metrics"]) < best[0]:
        kept = copy.deepcopy(net.state_dict())
        best = (
            held_out_score(resumed["metrics"]),
            resumed["selected_step"],
            kept,
            resumed["metrics"],
        )
    order = random.Random(settings.seed)
    schedule = [
        i
        for _ in range(math.ceil(settings.steps / len(examples)))
        for i in order.sample(range(len(examples)), len(examples))
    ]
    running: dict[str, float] = {}
    t0 = time.perf_counter()
    for step in range(start, settings.steps):
        ex = examples[schedule[step]]
        parts = losses(loaded, net, docs[ex.doc], ex, settings)
        opt.zero_grad(set_to_none=True)
        parts["loss"].backward()
        opt.step()
        for k, v in parts.items():
            value = float(v.detach())
            running[k] = 0.9 * running.get(k, value) + 0.1 * value
        if progress:
            progress(step + 1, settings.steps)
        if (step + 1) % 10 == 0 or step + 1 == settings.steps:
            log(
                f"step {step + 1}/{settings.steps} "
                + " ".join(f"{k} {v:.4f}" for k, v in running.items())
                + f" ({time.perf_counter() - t0:.0f} s)"
            )
        if (step + 1) % settings.save_every == 0 and step + 1 < settings.steps:
            save(out, net, opt, loaded, settings, step + 1, running, {}, base)
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            metrics = evaluate(loaded, net, docs, held, settings)
            log(f"step {step + 1} (held out): {metrics}")
            if held_out_score(metrics) < best[0]:
                best = (held_out_score(metrics), step + 1, copy.deepcopy(net.state_dict()), metrics)
    _, chosen, weights, metrics = best
    log(f"kept the weights of step {chosen} (lowest held-out KL to the teacher; 0 = untrained)")
    net.load_state_dict(weights)
    save(
        out, net, opt, loaded, settings, max(start, settings.steps), running, metrics, base, chosen
    )
    return {
        "parameters": net.num_parameters(),
        "selected_step": chosen,
        **metrics,
        "training_free": base,
    }
