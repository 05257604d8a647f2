"""Threads: --threads beats $SEKV_THREADS beats $OMP_NUM_THREADS beats the default."""

from __future__ import annotations

import pytest
import torch

from sekv_core.errors import SekvError
from sekv_core.threads import apply_threads, default_threads, resolve_threads


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("SEKV_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return monkeypatch


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_option_beats_env_beats_default(env):
    assert resolve_threads(None) == default_threads()
    env.setenv("OMP_NUM_THREADS", "5")
    assert resolve_threads(None) == 5
    env.setenv("SEKV_THREADS", " 3 ")
    assert resolve_threads(None) == 3
    assert resolve_threads(2) == 2
    env.setenv("SEKV_THREADS", "")  # empty: unset
    assert resolve_threads(None) == 5


def test_default_is_a_few_threads(env, monkeypatch):
    for cores, expected in ((None, 1), (1, 1), (2, 1), (4, 2), (8, 4), (64, 4)):
        monkeypatch.setattr("os.cpu_count", lambda c=cores: c)
        assert default_threads() == expected


@pytest.mark.parametrize("value", ["x", "0", "-2", "1.5"])
def test_a_bad_sekv_threads_is_an_actionable_error(env, value):
    env.setenv("SEKV_THREADS", value)
    with pytest.raises(
        SekvError, match=f"SEKV_THREADS must be a positive whole number, not '{value}'"
    ):
        resolve_threads(None)


def test_a_foreign_omp_value_falls_back_to_the_default(env):
    env.setenv("OMP_NUM_THREADS", "4,2")  # nested OpenMP levels: not ours to refuse
    assert resolve_threads(None) == default_threads()


def test_option_below_one_is_refused(env):
    with pytest.raises(SekvError):
        resolve_threads(0)


def test_apply_threads_reaches_torch(restore_threads):
    apply_threads(2)
    assert torch.get_num_threads() == 2
    apply_threads(1)
    assert torch.get_num_threads() == 1
