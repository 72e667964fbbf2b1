"""Executor state that only tests read."""

from __future__ import annotations

import gc

from executor.multiproc import MultiprocExecutor


def is_failed(executor: MultiprocExecutor) -> bool:
    """True once a worker died or the executor was shut down."""
    return executor._dead is not None


def frozen_object_count(_worker: object = None) -> int:
    """Objects in the permanent generation (0 until a freeze); callable as a worker RPC (sent
    pickled by reference: the worker imports this module from the parent's sys.path)."""
    return gc.get_freeze_count()
