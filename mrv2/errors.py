"""The engine's process errors (`EngineDeadError`, `WorkerStartupError`, `WorkerError`), under
the name users of mrv2 import them by. They are defined with the process layer that raises
them, in executor/errors.py: mrv2 depends on executor, never the reverse."""

from __future__ import annotations

from executor.errors import EngineDeadError, WorkerError, WorkerStartupError

__all__ = ["EngineDeadError", "WorkerError", "WorkerStartupError"]
