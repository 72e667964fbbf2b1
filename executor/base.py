"""Executor interface: the two-phase step RPC plus collective calls to every worker."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # names for type checkers only: executor imports nothing from mrv2
    from mrv2.config import EngineConfig
    from mrv2.protocol import GrammarOutput, ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.num_kv_blocks = 0

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), timeout: float | None = None
                       ) -> list[Any]:
        """Call `method(*args)` on every worker; one result per worker."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False
                      ) -> Future[None] | None:
        """Phase 1 of a step: state update, inputs, forward."""

    @abstractmethod
    def sample_tokens(self, grammar_output: GrammarOutput | None, non_block: bool = False
                      ) -> Future[ModelRunnerOutput] | ModelRunnerOutput:
        """Phase 2 of a step: sampling and the step's output."""

    def shutdown(self) -> None:
        """Release workers; idempotent."""

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` (from any thread) once the executor fails on its own, e.g. a
        worker died while nothing was asked of it; at once if it already has. An executor whose
        worker runs in the caller's process cannot fail so: the default never calls it."""

    def initialize(self) -> int:
        """Load weights and size and allocate the KV cache; returns the number of blocks."""
        self.collective_rpc("load_model")
        num_blocks = min(self.collective_rpc("determine_num_kv_blocks"))
        self.collective_rpc("initialize_kv_cache", (num_blocks,))
        self.num_kv_blocks = num_blocks
        return num_blocks
