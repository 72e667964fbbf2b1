"""Executor state that only tests read."""

from __future__ import annotations

import gc

from executor.multiproc import MultiprocExecutor


def is_failed(executor: MultiprocExecutor) -> bool:
    """True once a worker died or the executor was shut down."""
    return executor._dead is not None


def worker_pids(executor: MultiprocExecutor) -> list[int]:
    return [proc.pid for proc in executor._procs]


def shm_names(executor: MultiprocExecutor) -> list[str]:
    """The shared-memory segments the executor's queues use (/dev/shm/<name> on Linux)."""
    return [executor._requests.name, *executor._response_names]


def frozen_object_count(_worker: object = None) -> int:
    """Objects in the permanent generation (0 until a freeze); callable as a worker RPC (sent
    pickled by reference: the worker imports this module from the parent's sys.path)."""
    return gc.get_freeze_count()
