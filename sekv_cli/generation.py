"""Generation options shared by `ask` and `chat`: greedy by default, sampling on request."""

from __future__ import annotations

import math

import typer


def finite(value: float) -> float:
    """A typer callback: refuse inf and nan (a usage error saying so)."""
    if not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number; pass a finite value")
    return value


def temperature_value(value: float) -> float:
    if finite(value) < 0:
        raise typer.BadParameter(f"{value} is negative; pass 0 (greedy) or more")
    return value


def top_p_value(value: float) -> float:
    if not 0 < finite(value) <= 1:
        raise typer.BadParameter(f"{value} is not in (0, 1]; pass e.g. 0.9")
    return value


TEMPERATURE_OPTION = typer.Option(
    0.0,
    "--temperature",
    callback=temperature_value,
    help="0: greedy, the same answer every time; above 0: sample (higher: more varied).",
)
TOP_P_OPTION = typer.Option(
    1.0,
    "--top-p",
    callback=top_p_value,
    help="With --temperature: sample among the likeliest tokens holding this probability.",
)
SEED_OPTION = typer.Option(
    None,
    "--seed",
    help="With --temperature: the sampling seed (same seed, same answer; default: none, a "
    "fresh draw each time).",
)


def check_sampling(temperature: float, top_p: float, seed: int | None) -> None:
    """A usage error for sampling options given without sampling (``temperature`` 0)."""
    if temperature > 0:
        return
    for given, option in ((seed is not None, "--seed"), (top_p != 1, "--top-p")):
        if given:
            raise typer.BadParameter(
                "it applies to sampling only; add --temperature above 0 (0 is greedy)",
                param_hint=option,
            )


def sampling(temperature: float, top_p: float, seed: int | None):
    """The :class:`sekv_core.sampling.Sampling` of these options (None: greedy)."""
    if temperature == 0:
        return None
    from sekv_core.sampling import Sampling  # torch: the session is open by now

    return Sampling(temperature, top_p, seed)
