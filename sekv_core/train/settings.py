"""What one `sekv train` run is set to: corpus, schedule, loss weights and evaluation shares."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 300  # optimizer steps, one example each
    docs: int = 8  # generated training documents
    held_out: int = 2  # generated documents kept for evaluation and model selection
    seed: int = 0  # of the corpus, the example order and the initial weights
    lr: float = 5e-3  # Adam learning rate
    rho: float = 0.9  # a position's zoom targets: the fewest spans holding this share of its mass
    # weights of the loss terms (see sekv_core.train.losses)
    w_order: float = 1.0
    w_zoom: float = 1.0
    w_budget: float = 0.5
    dim: int = 3  # the gate's routing space (see sekv_core.zoom.zoomnet)
    doc_tokens: tuple[int, int] = (500, 1500)  # training document length range
    # zoom budgets drawn per step (share of span tokens); memory targets of 10-20% of full KV
    # leave ~4-18% of the span tokens to zoom once the resident tier is paid (8-bit zoom)
    budget_shares: tuple[float, float] = (0.02, 0.2)
    eval_shares: tuple[float, ...] = (0.05, 0.1, 0.15)
    # answers under a tight memory target route with the sketch's strongest half (see
    # methods.sekv.SeKV.zoom_budget): steps below this budget share route with either, half
    # the time, so that the gate learns both
    half_sketch_below: float = 0.12
    # answers to distil along: the teacher's own greedy answer up to this many tokens (what
    # `sekv bench fidelity` compares along), 0: the planted fact's answer string
    answer_tokens: int = 24
    save_every: int = 50  # checkpoint (weights + optimizer state) every this many steps
    eval_every: int = 100  # held-out evaluation; the router file keeps the best one (step 0 too)
