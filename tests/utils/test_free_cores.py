"""Kernel threads fitted to the cores other processes leave free: the arithmetic on
/proc/stat's ticks, the sampling interval, and the worker's use of it."""

from __future__ import annotations

import numba
import pytest
import torch

from mrv2.utils import free_cores

STAT = """cpu  100 0 100 800 0 0 0 0 0 0
cpu0 {busy0} 0 0 {idle0} 0 0 0 0 0 0
cpu1 {busy1} 0 0 {idle1} 0 0 0 0 0 0
cpu2 500 0 0 500 0 0 0 0 0 0
intr 12345
"""


class FakeMachine:
    """Two cores the process may use (a third it may not); ticks at 100 a second."""

    def __init__(self) -> None:
        self.now, self.own = 0.0, 0.0
        self.ticks = {"busy0": 0, "idle0": 0, "busy1": 0, "idle1": 0}

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        """`seconds` pass with this process on `own_cores` and others on `other_cores`."""
        self.now += seconds
        self.own += own_cores * seconds
        busy = (own_cores + other_cores) * seconds * 100
        for cpu in ("0", "1"):
            self.ticks["busy" + cpu] += round(busy / 2)
            self.ticks["idle" + cpu] += round(seconds * 100 - busy / 2)

    def fitter(self, max_threads: int = 2) -> free_cores.FreeCoreThreads:
        fitter = free_cores.FreeCoreThreads(
            max_threads, cpus={0, 1}, read_stat=lambda: STAT.format(**self.ticks),
            own_seconds=lambda: self.own, clock=lambda: self.now)
        fitter.ticks_per_second = 100
        return fitter


def test_ticks_of_the_allowed_cpus_only():
    stat = STAT.format(busy0=30, idle0=70, busy1=10, idle1=90)
    assert free_cores.busy_and_total_ticks(stat, {0, 1}) == (40, 200)
    assert free_cores.busy_and_total_ticks(stat, {2}) == (500, 1000)


def test_threads_follow_the_cores_others_take():
    machine = FakeMachine()
    fitter = machine.fitter()
    machine.run(1.0, own_cores=2.0, other_cores=0.0)  # alone, both threads busy
    assert fitter.update() == 2
    machine.run(1.0, own_cores=1.0, other_cores=1.0)  # a neighbour takes one core
    assert fitter.update() == 1
    machine.run(0.2, own_cores=1.0, other_cores=0.0)
    assert fitter.update() == 1  # within SAMPLE_SECONDS: no new sample
    machine.run(1.0, own_cores=1.0, other_cores=0.1)  # the neighbour left
    assert fitter.update() == 2
    machine.run(1.0, own_cores=0.0, other_cores=2.0)  # both cores taken: still one thread
    assert fitter.update() == 1
    capped = machine.fitter(max_threads=1)
    machine.run(1.0, own_cores=0.0, other_cores=0.0)
    assert capped.update() == 1


def test_fit_sets_numba_threads_and_leaves_torchs(monkeypatch):
    """torch's pool keeps its count: oneDNN's bfloat16 linears give other bits at 1 and 2
    threads for some shapes, so a fitted torch pool would make results follow the load."""
    machine = FakeMachine()
    fitter = machine.fitter()
    before = numba.get_num_threads(), torch.get_num_threads()
    try:
        machine.run(1.0, own_cores=1.0, other_cores=1.0)
        free_cores.fit_kernel_threads(fitter)
        assert numba.get_num_threads() == 1 and torch.get_num_threads() == before[1]
    finally:
        numba.set_num_threads(before[0])
        torch.set_num_threads(before[1])


@pytest.mark.parametrize("value, expected", [("0", False), ("1", True)])
def test_the_environment_turns_it_off(monkeypatch, value, expected):
    monkeypatch.setenv(free_cores.ENV, value)
    assert free_cores.enabled() is expected


def test_reads_this_machine():
    fitter = free_cores.FreeCoreThreads(2)
    fitter._last = (fitter._last[0] - 1.0,) + fitter._last[1:]
    assert 1 <= fitter.update() <= 2


def test_processes_that_share_the_cores_start_with_their_share(monkeypatch):
    monkeypatch.setattr(free_cores.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert free_cores.pool_env(1) == {}
    assert free_cores.pool_env(2) == {"NUMBA_NUM_THREADS": "4", "OMP_NUM_THREADS": "4"}
    assert free_cores.pool_env(16) == {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    # A size in the environment (the user's, or a data-parallel core's share) is the budget
    # its processes split: the ranks of a core nest inside its share.
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    assert free_cores.pool_env(2) == {"NUMBA_NUM_THREADS": "4", "OMP_NUM_THREADS": "3"}
    # Another machine's cores (a Ray rank placed there) are its own budget.
    assert free_cores.pool_env(2, cores=32) == {"NUMBA_NUM_THREADS": "16",
                                                "OMP_NUM_THREADS": "16"}
