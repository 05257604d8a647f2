"""Generation options shared by `ask` and `chat`: greedy by default, sampling on request."""

from __future__ import annotations

import typer

REPETITION_PENALTY = 1.0  # see README: the default keeps answers as the benchmarks measure them

TEMPERATURE_OPTION = typer.Option(
    0.0,
    "--temperature",
    min=0.0,
    help="0: greedy, the same answer every time; above 0: sample (higher: more varied).",
)
TOP_P_OPTION = typer.Option(
    1.0,
    "--top-p",
    min=0.01,
    max=1.0,
    help="With --temperature: sample among the likeliest tokens holding this probability.",
)
SEED_OPTION = typer.Option(
    None,
    "--seed",
    help="With --temperature: the sampling seed (same seed, same answer; default: none, a "
    "fresh draw each time).",
)
REPETITION_OPTION = typer.Option(
    REPETITION_PENALTY,
    "--repetition-penalty",
    min=0.01,
    help="Above 1: tokens the answer already used become less likely (stops loops; 1: off).",
)
REPEATS_OPTION = typer.Option(
    False,
    "--allow-repeats",
    help="Let the answer repeat a sentence it already wrote (by default it ends there: a "
    "greedy answer that repeats a sentence is in a loop).",
)
STOP_OPTION = typer.Option(
    [], "--stop", metavar="TEXT", help="End the answer before this text (repeatable)."
)


def sampling(temperature: float, top_p: float, seed: int | None, repetition_penalty: float):
    """The :class:`sekv_core.sampling.Sampling` of these options."""
    from sekv_core.sampling import Sampling  # torch: the session is open by now

    return Sampling(temperature, top_p, seed, repetition_penalty)
