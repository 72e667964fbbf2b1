"""Executors move each step from the engine core to the workers and the output back."""

from executor.base import Executor
from executor.uniproc import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
