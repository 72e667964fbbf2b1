"""A worker double whose phase 2 answers with a Deferred that takes `RESOLVE_S` to resolve, and
which records when each phase 1 starts: with the output resolved off the worker's main loop,
step N+1's phase 1 starts before step N's output is ready. Imported by name (worker_cls) in
the executor's process and in spawned worker processes (they inherit sys.path)."""

from __future__ import annotations

import time

from executor.deferred import Deferred

RESOLVE_S = 0.5


class _SlowOutput(Deferred[float]):
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def resolve(self) -> float:
        time.sleep(RESOLVE_S)
        if self.fail:
            raise ValueError("the output copy failed")
        return time.time()


class DeferringWorker:
    def __init__(self, config: object) -> None:
        self.starts: list[float] = []

    def execute_model(self, step: int) -> None:
        self.starts.append(time.time())

    def sample_tokens(self, fail: bool) -> float | Deferred[float]:
        """Phase 2: the time its output was resolved (after RESOLVE_S)."""
        return _SlowOutput(fail)

    def execute_starts(self) -> list[float]:
        return self.starts
