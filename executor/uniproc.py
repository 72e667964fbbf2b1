"""UniProcExecutor: the worker lives in the caller's process.

The worker class is named by `worker_cls` ("module:Class", mrv2's Worker by default) and
imported on construction, as MultiprocExecutor's workers do: executor imports nothing from mrv2.

`non_block=True` returns a future, so the engine core drives both executors through one
interface: phase 1's completes at once; phase 2's when the step's output copy has landed,
resolved on a reply thread (executor/deferred.py) while the caller goes on to the next step.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from executor.base import Executor
from executor.deferred import Deferred, OrderedReplies
from executor.process import settle
from executor.worker_proc import make_worker

if TYPE_CHECKING:  # names for type checkers only: executor imports nothing from mrv2
    from mrv2.config import EngineConfig
    from mrv2.protocol import GrammarOutput, ModelRunnerOutput, SchedulerOutput


def _done(value: Any = None, error: BaseException | None = None) -> Future:
    future: Future = Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
    return future


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, *, worker_cls: str = "mrv2.worker:Worker") -> None:
        super().__init__(config)
        self.worker = make_worker(worker_cls, config, 0, None)
        self._replies = OrderedReplies("mrv2-uniproc-replies")

    def collective_rpc(self, method: str, args: tuple = (), timeout: float | None = None
                       ) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False
                      ) -> Future[None] | None:
        if not non_block:
            return self.worker.execute_model(scheduler_output)
        try:
            return _done(self.worker.execute_model(scheduler_output))
        except Exception as error:  # surfaced through the future, like a remote worker's
            return _done(error=error)

    def sample_tokens(self, grammar_output: GrammarOutput | None, non_block: bool = False
                      ) -> Future[ModelRunnerOutput] | ModelRunnerOutput:
        if not non_block:
            output = self.worker.sample_tokens(grammar_output)
            return output.resolve() if isinstance(output, Deferred) else output
        try:
            output = self.worker.sample_tokens(grammar_output)
        except Exception as error:
            return _done(error=error)
        future: Future = Future()
        self._replies.submit(output, lambda value, error: settle(future, value, error))
        return future

    def shutdown(self) -> None:
        self._replies.drain(timeout=5.0)
