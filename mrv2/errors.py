"""The engine's errors, under the names users of mrv2 import them by: `ConfigError`, and the
process errors (`EngineDeadError`, `WorkerStartupError`, `WorkerError`), which are defined with
the process layer that raises them, in executor/errors.py (mrv2 depends on executor, never the
reverse)."""

from __future__ import annotations

from executor.errors import EngineDeadError, WorkerError, WorkerStartupError

__all__ = ["ConfigError", "EngineDeadError", "WorkerError", "WorkerStartupError"]


class ConfigError(ValueError):
    """An engine argument is invalid. Raised before any model work starts."""

