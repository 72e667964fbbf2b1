"""EngineCore: the step loop around the scheduler and the executor.

One `step()` schedules, runs phase 1 and phase 2 through the executor, and folds the sampled
tokens back into the scheduler. A step with nothing to run still reaches the runner when it
carries finished request ids, so their slots are freed promptly.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from mrv2.config import EngineConfig
from mrv2.core.request import Request, RequestStatus
from mrv2.core.scheduler import Scheduler
from mrv2.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerOutput

if TYPE_CHECKING:
    from executor.base import Executor


def executor_class_for(config: EngineConfig) -> "type[Executor]":
    # Imported on demand: a process loads only the executor it runs (the multiprocess one
    # brings ZMQ and the shared-memory queue).
    backend = config.parallel_config.distributed_executor_backend
    if backend == "mp":
        from executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from executor.ray_executor import RayExecutor

        return RayExecutor
    from executor.uniproc import UniProcExecutor

    return UniProcExecutor


def call_on_worker(method: str | Callable, kwargs: dict[str, Any], worker: Any,
                   *args: Any) -> Any:
    """vLLM's run_method: `worker.method(*args, **kwargs)`, or `method(worker, ...)` for a
    callable. Module level, so that a partial of it pickles to a worker process."""
    if callable(method):
        return method(worker, *args, **kwargs)
    if method.startswith("_"):
        raise AttributeError(f"{method!r} is private: not callable over RPC")
    return getattr(worker, method)(*args, **kwargs)


class EngineCore:
    def __init__(self, config: EngineConfig,
                 executor_class: "type[Executor] | None" = None) -> None:
        if executor_class is None:
            executor_class = executor_class_for(config)
        self.config = config
        self.executor = executor_class(config)
        num_blocks = self.executor.initialize()
        self.scheduler = Scheduler(config, num_blocks)
        # Steps submitted to the executor and not yet folded back into the scheduler, with
        # when each was scheduled.
        self.batch_queue: deque[tuple[SchedulerOutput, Future, float]] = deque()
        self.max_steps_in_flight = config.max_steps_in_flight
        self.sleep_level = 0  # 0 awake; 1 or 2 as given to sleep()

    def add_request(self, request: EngineCoreRequest) -> None:
        if self.sleep_level:
            raise ValueError(f"request {request.request_id!r}: the engine is asleep (level "
                             f"{self.sleep_level}); call wake_up() first")
        self.scheduler.add_request(
            Request.from_engine_core_request(request, self.config.model_config.max_model_len))

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (Worker.sleep): level 1 frees the KV cache, level 2 the weights
        too. The engine must be idle; the prefix cache is forgotten (its blocks' contents go)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level={level!r}: expected 1 (KV cache) or 2 (KV cache "
                             f"and weights)")
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError(f"sleep needs an idle engine: "
                               f"{self.scheduler.get_num_unfinished_requests()} request(s) "
                               f"unfinished")
        # No request runs or waits, but the last one's bookkeeping may lag a step (async
        # scheduling: a step in flight, finished ids the runner has not been told yet): finish
        # it, so every slot is free before the memory goes. Each step only flushes.
        while self.has_unfinished_requests():
            self.step()
        if not self.sleep_level:
            self.scheduler.reset_prefix_cache()
        self.executor.collective_rpc("sleep", (max(level, self.sleep_level),))
        self.sleep_level = max(level, self.sleep_level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo sleep(): the KV cache (and weights) come back. vLLM's `tags` ("weights",
        "kv_cache") wake parts separately; mrv2 wakes everything, so only all of them."""
        if tags is not None and set(tags) != {"weights", "kv_cache"}:
            raise ValueError(f"wake_up(tags={tags!r}): mrv2 wakes the weights and the KV cache "
                             f"together; pass no tags")
        if self.sleep_level:
            self.executor.collective_rpc("wake_up")
            self.sleep_level = 0

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or a finished one still holds a runner slot."""
        return (self.scheduler.has_unfinished_requests()
                or self.scheduler.has_finished_requests() or bool(self.batch_queue))

    def step(self) -> EngineCoreOutputs:
        """Submit the next step if fewer than `max_steps_in_flight` are running, then fold in
        the oldest one's output. With async scheduling a fresh submission returns at once
        while the queue is not full, so step N+1 is scheduled while step N runs."""
        submitted = False
        outputs = None
        if len(self.batch_queue) < self.max_steps_in_flight:
            started = time.perf_counter()
            scheduler_output = self.scheduler.schedule()
            if not (scheduler_output.is_empty and not scheduler_output.finished_req_ids
                    and not scheduler_output.preempted_req_ids):
                self.executor.execute_model(scheduler_output, non_block=True)
                # While the forward runs: the grammar bitmask, from matchers that must have
                # seen the step in flight's tokens, so that one is folded in first.
                if self.batch_queue and self.scheduler.structured_outputs.has_live_requests:
                    outputs = self._fold_oldest_step()
                grammar_output = self.scheduler.get_grammar_output(scheduler_output)
                future = self.executor.sample_tokens(grammar_output, non_block=True)
                self.batch_queue.append((scheduler_output, future, started))
                submitted = not scheduler_output.is_empty
        if outputs is None and self.batch_queue and not (
                submitted and len(self.batch_queue) < self.max_steps_in_flight):
            outputs = self._fold_oldest_step()
        return EngineCoreOutputs(outputs=outputs or [], timestamp=time.monotonic())

    def _fold_oldest_step(self) -> list[EngineCoreOutput]:
        scheduler_output, future, started = self.batch_queue.popleft()
        outputs = self.scheduler.update_from_output(scheduler_output, future.result())
        elapsed = time.perf_counter() - started
        self.scheduler.run_length.record(scheduler_output.num_decode_steps, elapsed)
        policy = self.scheduler.draft_policy  # speculative decoding: what a row costs
        if policy is not None:
            policy.record_step(scheduler_output, elapsed)
        return outputs

    def collective_rpc(self, method: str | Callable, timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's: `method(*args, **kwargs)` on every worker, one result per rank. A plain
        method name goes through the executor's own RPC; a callable or keyword arguments
        travel as a (pickled, for worker processes) partial of `call_on_worker`, and the
        in-process worker is called directly."""
        args = tuple(args)
        if isinstance(method, str) and not kwargs:
            if method.startswith("_"):
                raise AttributeError(f"{method!r} is private: not callable over RPC")
            return self.executor.collective_rpc(method, args, timeout)
        call = functools.partial(call_on_worker, method, dict(kwargs or {}))
        worker = getattr(self.executor, "worker", None)  # UniProcExecutor's, in this process
        if worker is not None:
            return [call(worker, *args)]
        return self.executor.collective_rpc(call, args, timeout)

    def shutdown(self) -> None:
        self.scheduler.structured_outputs.shutdown()
        self.executor.shutdown()
