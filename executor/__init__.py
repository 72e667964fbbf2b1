"""Executors move each step from the engine core to the workers and the output back.

Names are imported on first use, so that a process that needs only the transport
(`executor.shm_queue`, `executor.serial`) does not import the model stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from executor.base import Executor
    from executor.multiproc import MultiprocExecutor
    from executor.ray_executor import RayExecutor
    from executor.uniproc import UniProcExecutor

_EXPORTS = {"Executor": "executor.base", "UniProcExecutor": "executor.uniproc",
            "MultiprocExecutor": "executor.multiproc", "RayExecutor": "executor.ray_executor"}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'executor' has no attribute {name!r}")
