"""Kernel threads fitted to the cores other processes leave free (CPU workers).

Why: the kernels' threads meet at a barrier at the end of every parallel region (a batch-1
decode step of SmolLM2 runs ~180 of them). When another process takes one of two cores, a
thread waits at each barrier for a peer the scheduler has paused, and OpenMP's waiting threads
spin while they wait: batch-1 decode fell to a quarter of its speed next to one busy process
(bench/test_busy_neighbour.py), where one thread alone keeps its full single-core speed. A
passive wait policy (OMP_WAIT_POLICY=PASSIVE) helps under contention but costs more than half
the speed on an idle machine (each region then wakes sleeping threads).

So every `SAMPLE_SECONDS` the worker reads the busy time of the cores it may run on
(/proc/stat, its affinity set) minus its own CPU time, and runs `free cores` threads (rounded,
at least 1, at most the configured count). Its own threads' spinning is its own time, so it
does not see itself as a neighbour; the other processes of an mrv2 server (the API process)
count, as they take cores too.

Numerics: the fitting never changes a result. Only numba's count is fitted: the decode
attention's work split is planned for numba's pool size whatever runs now
(decode_numba.planned_threads), and no other numba kernel's sums depend on its thread count.
torch's intra-op pool keeps its count: oneDNN's bfloat16 linears give other bits at 1 and 2
threads for some shapes. `MRV2_FIT_THREADS_TO_FREE_CORES=0` turns the fitting off.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numba

ENV = "MRV2_FIT_THREADS_TO_FREE_CORES"
SAMPLE_SECONDS = 0.5


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


@contextmanager
def off_while_loading() -> Iterator[None]:
    """Fitting off for the workers loaded inside the block (a worker reads ENV as it loads its
    model); the previous setting is back after it."""
    before = os.environ.get(ENV)
    os.environ[ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = before


def read_proc_stat() -> str:
    with open("/proc/stat") as f:
        return f.read()


def busy_and_total_ticks(stat: str, cpus: set[int]) -> tuple[int, int]:
    """(busy, total) clock ticks of `cpus` from /proc/stat's per-cpu lines (idle and iowait are
    not busy; steal, time the hypervisor gave another guest, is)."""
    busy = total = 0
    for line in stat.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        if int(name[3:]) not in cpus:
            continue
        ticks = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
    return busy, total


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class FreeCoreThreads:
    """The thread count of this process's kernels, refitted at most every SAMPLE_SECONDS."""

    def __init__(self, max_threads: int, *, cpus: set[int] | None = None,
                 read_stat: Callable[[], str] = read_proc_stat,
                 own_seconds: Callable[[], float] = own_cpu_seconds,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_threads = max(1, max_threads)
        self.cpus = cpus if cpus is not None else set(os.sched_getaffinity(0))
        self.read_stat, self.own_seconds, self.clock = read_stat, own_seconds, clock
        self.ticks_per_second = os.sysconf("SC_CLK_TCK")
        self.threads = self.max_threads
        self._last = self._sample()

    def _sample(self) -> tuple[float, int, int, float]:
        busy, total = busy_and_total_ticks(self.read_stat(), self.cpus)
        return self.clock(), busy, total, self.own_seconds()

    def update(self) -> int:
        """Refit when SAMPLE_SECONDS have passed since the last sample; the thread count."""
        if self.clock() - self._last[0] < SAMPLE_SECONDS:
            return self.threads
        now = self._sample()
        busy = now[1] - self._last[1]
        total = now[2] - self._last[2]
        own = (now[3] - self._last[3]) * self.ticks_per_second
        self._last = now
        if total <= 0:
            return self.threads
        others = max(0.0, (busy - own) / total * len(self.cpus))
        self.threads = max(1, min(self.max_threads, round(len(self.cpus) - others)))
        return self.threads


def fit_kernel_threads(free: FreeCoreThreads) -> None:
    """Run the numba kernels launched from this thread (numba's count is per launching thread)
    on `free`'s current count; torch's pool is left as it is (see Numerics above)."""
    threads = free.update()
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)


POOL_SIZE_VARS = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS")


def pool_env(processes: int, cores: int | None = None) -> dict[str, str]:
    """The thread-pool sizes each of `processes` processes that share cores starts with:
    its share of the budget in numba's and OpenMP's pools (sized when they load, so they must
    be in the environment the process starts with; a pool larger than its share spins on cores
    the other processes compute on). Used for data-parallel engine cores and for the ranks of
    one engine on one machine, nested: a rank's budget is its engine core's share.

    The budget of each pool: `cores` (another machine's, for a Ray rank placed there), else the
    pool size set in this process's environment (the user's, or this process's own share),
    else the cores this process may run on. Nothing for one process."""
    if processes <= 1:
        return {}
    env = {}
    for name in POOL_SIZE_VARS:
        budget = cores or int(os.environ.get(name) or len(os.sched_getaffinity(0)))
        env[name] = str(max(1, budget // processes))
    return env
