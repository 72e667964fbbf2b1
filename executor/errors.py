"""Errors that cross the engine's process boundaries.

- `EngineDeadError`: a worker (or the engine core) died; every pending and later call fails
  fast with it. Not recoverable: build a new engine.
- `WorkerStartupError`: a worker process could not start; carries the worker's traceback text.
- `WorkerError`: a worker raised an exception whose type cannot be rebuilt in this process;
  carries the remote type name and traceback text.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine lost a process it cannot run without."""


class WorkerError(RuntimeError):
    """An exception raised inside a worker process."""

    def __init__(self, message: str, *, rank: int | None = None, exc_type: str = "",
                 remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback


class WorkerStartupError(WorkerError):
    """A worker process failed (or timed out) before it reported ready."""
