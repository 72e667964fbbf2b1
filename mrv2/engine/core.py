"""EngineCore: the step loop around the scheduler and the executor.

One `step()` schedules, runs phase 1 and phase 2 through the executor, and folds the sampled
tokens back into the scheduler. A step with nothing to run still reaches the runner when it
carries finished request ids, so their slots are freed promptly.
"""

from __future__ import annotations

import time

from typing import TYPE_CHECKING

from mrv2.config import EngineConfig
from mrv2.engine.request import Request, RequestStatus
from mrv2.engine.scheduler import Scheduler
from mrv2.protocol import EngineCoreOutputs, EngineCoreRequest, GrammarOutput

if TYPE_CHECKING:
    from executor.base import Executor


class EngineCore:
    def __init__(self, config: EngineConfig,
                 executor_class: "type[Executor] | None" = None) -> None:
        # Imported here: `executor` imports mrv2, so a module-level import would be circular
        # for a process that imports `executor` first.
        if executor_class is None:
            from executor.uniproc import UniProcExecutor as executor_class
        self.config = config
        self.executor = executor_class(config)
        num_blocks = self.executor.initialize()
        self.scheduler = Scheduler(config, num_blocks)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(
            Request.from_engine_core_request(request, self.config.model_config.max_model_len))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or a finished one still holds a runner slot."""
        return (self.scheduler.has_unfinished_requests()
                or self.scheduler.has_finished_requests())

    def step(self) -> EngineCoreOutputs:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and not (scheduler_output.finished_req_ids
                                              or scheduler_output.preempted_req_ids):
            return EngineCoreOutputs(timestamp=time.monotonic())
        self.executor.execute_model(scheduler_output)
        runner_output = self.executor.sample_tokens(GrammarOutput())
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic())

    def shutdown(self) -> None:
        self.executor.shutdown()
