"""How many CPU threads torch uses: ``--threads``, else ``$SEKV_THREADS``, else
``$OMP_NUM_THREADS`` (torch's own setting, kept), else :func:`default_threads`; work spread
over threads (:func:`each_on_threads`), or a block held to one (:func:`one_thread`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

from .errors import SekvError

T, R = TypeVar("T"), TypeVar("R")

THREADS_ENV = "SEKV_THREADS"


def default_threads() -> int:
    """Threads when nothing says otherwise: half the cores, at most 4.

    Decoding runs many small per-token ops; on them extra threads lose more to start-up and
    spinning than they gain, most of all on a machine shared with other work.
    """
    return min(4, max(1, (os.cpu_count() or 1) // 2))


def resolve_threads(option: int | None) -> int:
    """The thread count to use: the option if given, else ``$SEKV_THREADS``, else a plain
    positive ``$OMP_NUM_THREADS``, else :func:`default_threads` (an empty variable is unset).

    Raises
    ------
    SekvError
        If the option is below 1 or ``$SEKV_THREADS`` is not a positive whole number.
    """
    if option is not None:
        if option < 1:
            raise SekvError(f"threads must be at least 1, not {option}")
        return option
    value = os.environ.get(THREADS_ENV, "").strip()
    if value:
        threads = _positive(value)
        if threads is None:
            raise SekvError(f"{THREADS_ENV} must be a positive whole number, not {value!r}")
        return threads
    omp = _positive(os.environ.get("OMP_NUM_THREADS", "").strip())  # not ours to refuse
    return omp if omp is not None else default_threads()


def apply_threads(threads: int) -> None:
    """Set torch's intra-op CPU threads (call before the model loads)."""
    import torch

    torch.set_num_threads(threads)


def _positive(value: str) -> int | None:
    try:
        number = int(value)
    except ValueError:
        return None
    return number if number >= 1 else None


def each_on_threads(
    fn: Callable[[T], R], items: Iterable[T], workers: int | None = None
) -> list[R]:
    """``fn(item)`` for every item, spread over ``workers`` threads (default: torch's
    intra-op thread count). ``fn`` spends its time in torch ops or native calls, which release
    the GIL; run it on one intra-op thread where its result must not depend on how many run
    at once."""
    import torch  # (the CLI reads this module before torch is needed)

    items = list(items)
    workers = min(workers or torch.get_num_threads(), len(items))
    if workers <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


@contextmanager
def one_thread() -> Iterator[None]:
    """Run a block on one intra-op thread: with several, the batch loop of small
    eigendecompositions and LAPACK compete for the cores (see docs/design.md)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
