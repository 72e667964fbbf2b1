"""The worker double for bench/test_executor_overlap.py's baseline: mrv2's Worker, except that
phase 2 waits for its output copy before returning (the behaviour before the worker's
overlap), so the multiprocess worker cannot receive step N+1 until step N's output is sent.
Imported by name (worker_cls) in the spawned worker process, which inherits sys.path."""

from __future__ import annotations

from mrv2.protocol import GrammarOutput, ModelRunnerOutput
from mrv2.worker import Worker


class BlockingPhase2Worker(Worker):
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return self.runner.sample_tokens(grammar_output)
