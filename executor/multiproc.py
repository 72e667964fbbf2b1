"""MultiprocExecutor: one worker process per rank, fed over a shared-memory broadcast queue.

Parent -> workers: every RPC is encoded once (executor/serial.py) and written to one
`ShmQueueWriter` that every worker reads. Workers -> parent: each worker writes its replies to
its own one-reader queue. Workers run calls in order and replies are matched to calls in order;
`execute_model` / `sample_tokens` are answered by the output rank only (the first rank of the
last pipeline stage, which samples; rank 0 without stages).

Futures are completed by the thread that asks for them (`result()`, `exception()`, `done()`
read replies on the caller's thread): no reply thread competes with the scheduler for the GIL.

Failure: a monitor thread waits on the worker sentinels. When a worker dies the executor is
marked dead, every pending future fails with `EngineDeadError`, waits in progress abort at
their next check (within `max_block_s`, 20 ms), the other workers are stopped and the shared
memory is unlinked; later calls raise at once. The worker side (and its death pipe) is in
executor/worker_proc.py.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import pickle
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

from executor.base import Executor
from executor.errors import EngineDeadError
from executor.process import (distributed_init_method, pipe, settle, spawn, stop_processes,
                              wait_ready, watch_processes)
from executor.serial import (ALL_RANKS, NO_REPLY, SHUTDOWN_METHOD, MethodTypes, MsgpackEncoder,
                             Ready, RPCCall)
from executor.shm_queue import (DEFAULT_CHUNK_BYTES, DEFAULT_NUM_CHUNKS, ShmQueueClosed,
                                ShmQueueReader, ShmQueueTimeout, ShmQueueWriter)
from executor.shm_segment import unlink_segment
from executor.worker_proc import import_object, worker_main

if TYPE_CHECKING:  # names for type checkers only: executor imports nothing from mrv2
    from executor.rank_broadcast import RankBroadcast
    from mrv2.config import EngineConfig
    from mrv2.protocol import GrammarOutput, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 3.0
# How long an error reply from a rank waits for another rank's death to show (tensor parallel
# only): a rank killed mid-collective resets its peers' connections while it exits, before
# its process is reaped, so its peers' errors can arrive first.
_DEATH_GRACE_S = 0.5


class RPCFuture(Future):
    """A Future completed by whoever asks for it: `result()`, `exception()` and `done()` read
    replies on the calling thread (done() without blocking). Callbacks run when it completes,
    which is inside one of those calls (or at once when the executor fails); use them, not
    `concurrent.futures.wait()`, which only watches. A sent RPC cannot be cancelled."""

    def __init__(self, drive: Callable[[Future, float | None], None]) -> None:
        super().__init__()
        self._drive = drive

    def result(self, timeout: float | None = None) -> Any:
        self._drive(self, timeout)
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._drive(self, timeout)
        return super().exception(timeout=0)

    def done(self) -> bool:
        if not super().done():
            try:
                self._drive(self, 0.0)
            except Exception:  # a poll: failures surface through result()
                pass
        return super().done()

    def cancel(self) -> bool:
        return False


class _Call:
    __slots__ = ("call_id", "method", "future", "reply_rank", "waiting", "results", "errors")

    def __init__(self, call_id: int, method: str | None, future: RPCFuture, reply_rank: int,
                 ranks: list[int]) -> None:
        self.call_id, self.method, self.future = call_id, method, future
        self.reply_rank, self.waiting = reply_rank, ranks
        self.results: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, *, worker_cls: str = "mrv2.worker:Worker",
                 num_chunks: int = DEFAULT_NUM_CHUNKS, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 startup_timeout_s: float = 300.0) -> None:
        super().__init__(config)
        parallel = config.parallel_config
        self.world_size = parallel.world_size
        # Where the tensor-parallel ranks meet (torch.distributed rendezvous); set by
        # _start_workers, None for one rank.
        self.distributed_init_method: str | None = None
        # The first rank of the last pipeline stage, which samples (rank 0 without stages).
        self.output_rank = self.world_size - parallel.tensor_parallel_size
        self._worker_type = import_object(worker_cls)
        self._types = MethodTypes(self._worker_type)
        self._encoder = MsgpackEncoder()
        self._ids = itertools.count()
        self._pending: deque[_Call] = deque()
        self._send_lock, self._reply_lock = threading.Lock(), threading.Lock()
        self._pending_lock, self._state_lock = threading.Lock(), threading.Lock()
        self._dead: str | None = None
        self._failure_callback: Callable[[str], None] | None = None
        self._closing = False
        self._procs: list = []
        self._death_w = None
        self._responses: list[ShmQueueReader] = []
        self._response_names: list[str] = []
        self._monitor: threading.Thread | None = None
        self._wake_r, self._wake_w = pipe()
        # The broadcast to every rank (set by _start_workers; rank_broadcast.py across nodes).
        self._requests: ShmQueueWriter | RankBroadcast | None = None
        ref = weakref.ref(self)
        atexit.register(lambda: (ex := ref()) is not None and ex.shutdown())
        try:
            self._start_workers(worker_cls, (num_chunks, chunk_bytes), startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._monitor = self._watch_workers()

    # -- start-up and failure: the hooks an executor of other processes (executor/ray.py)
    # overrides are _start_workers, _watch_workers, _exit_text, _exited_rank, _stop_workers.

    def _start_workers(self, worker_cls: str, queue_shape: tuple[int, int],
                       timeout: float) -> None:
        """Start one process per rank, reading the broadcast queue; fills `_responses`."""
        self._requests = ShmQueueWriter(self.world_size, *queue_shape)
        if self.world_size > 1:
            self.distributed_init_method = distributed_init_method()
        death_r, self._death_w = pipe()
        conns = []
        env = self._rank_env(self.world_size)
        for rank in range(self.world_size):
            ready_r, ready_w = pipe()
            self._procs.append(spawn(
                worker_main, (rank, self.config, worker_cls, self._requests.handle,
                              queue_shape, ready_w, death_r, self.distributed_init_method),
                name=f"mrv2-worker-{rank}", daemon=True, child_ends=(ready_w,), env=env))
            conns.append(ready_r)
        death_r.close()
        self._wait_ready(conns, timeout)

    def _rank_env(self, ranks_on_node: int, node_cores: int | None = None) -> dict[str, str]:
        """What a rank's process starts with, as the worker class declares it
        (`process_env(ranks_on_node, node_cores)`, e.g. its thread pools' sizes); nothing for
        a worker class that declares none."""
        process_env = getattr(self._worker_type, "process_env", None)
        return {} if process_env is None else process_env(ranks_on_node, node_cores)

    def _wait_ready(self, conns: list, timeout: float) -> None:
        readies = wait_ready(
            self._procs, conns, Ready, timeout,
            names=[f"worker rank {r}" for r in range(self.world_size)],
            timeout_message=lambda waiting: f"worker rank(s) {waiting}", with_rank=True,
            on_ready=lambda r, ready: self._response_names.append(ready.response.name))
        self._responses = [ShmQueueReader(ready.response, 0) for ready in readies]

    def _watch_workers(self) -> threading.Thread:
        def on_exit(rank: int) -> None:
            if not self._closing:
                self._fail_rank_died(rank)

        return watch_processes(self._procs, self._wake_r, on_exit, name="mrv2-worker-monitor")

    def _exit_text(self, rank: int, wait_s: float) -> str:
        """Names rank `rank`'s worker and how it ended (waiting up to `wait_s` to learn it)."""
        proc = self._procs[rank]
        proc.join(wait_s)
        return f"worker rank {rank} (pid {proc.pid}) exited (exit code {proc.exitcode})"

    def _fail_rank_died(self, rank: int) -> None:
        self._fail(f"{self._exit_text(rank, 0.1)}: it died unexpectedly; the engine cannot "
                   f"continue")

    def _fail(self, reason: str) -> None:
        with self._state_lock:
            if self._dead is not None:
                return
            self._dead = reason
        logger.error("MultiprocExecutor failed: %s", reason)
        self._fail_pending()
        if self._requests is not None:  # marks the queue closed: idle workers exit on their own
            self._requests.unlink()
        self._stop_workers(grace=0.5)
        for name in self._response_names:
            unlink_segment(name)
        if self._failure_callback is not None:
            self._failure_callback(reason)

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        with self._state_lock:
            failed = self._dead if not self._closing else None
            self._failure_callback = callback
        if failed is not None:
            callback(failed)

    def _fail_pending(self) -> None:
        with self._pending_lock:
            pending = list(self._pending)
        for call in pending:
            settle(call.future, error=EngineDeadError(self._dead))

    def _abort(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _stop_workers(self, grace: float) -> None:
        stop_processes(self._procs, grace)

    # -- RPC -------------------------------------------------------------------------------------

    def _submit(self, method: str | Callable, args: tuple, reply_rank: int,
                timeout: float | None = None) -> RPCFuture:
        function = None
        if callable(method):
            function, method = pickle.dumps(method), getattr(method, "__name__", "function")
        ranks = list(range(self.world_size)) if reply_rank == ALL_RANKS else [reply_rank]
        future = RPCFuture(self._drive)
        with self._send_lock:
            self._abort()
            call_id = next(self._ids)
            frames = self._encoder.encode(RPCCall(call_id, method, tuple(args), reply_rank,
                                                  function))
            call = _Call(call_id, None if function else method, future, reply_rank, ranks)
            with self._pending_lock:
                self._pending.append(call)
            try:
                self._requests.enqueue(frames, timeout=timeout, abort=self._abort)
            except BaseException:
                with self._pending_lock:
                    self._pending.remove(call)
                raise
        return future

    def _drive(self, future: Future, timeout: float | None) -> None:
        """Read replies, oldest call first, until `future` is done."""
        if Future.done(future):
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._reply_lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"no reply within {timeout} s (another thread is reading)")
        try:
            while not Future.done(future):
                with self._pending_lock:
                    call = self._pending[0]
                for rank in list(call.waiting):
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    try:
                        frames = self._responses[rank].dequeue(timeout=left, abort=self._abort)
                    except ShmQueueTimeout:
                        raise TimeoutError(f"RPC {call.method!r} (call {call.call_id}): no reply "
                                           f"from worker rank {rank} within {timeout} s") from None
                    except ShmQueueClosed:  # the worker left its loop: it is exiting
                        self._fail(f"{self._exit_text(rank, 1.0)} with call {call.call_id} "
                                   f"unanswered")
                        self._abort()
                    reply, value = self._types.decode_reply(frames, call.method)
                    if reply.call_id != call.call_id:
                        self._fail(f"worker rank {rank} answered call {reply.call_id} while call "
                                   f"{call.call_id} was expected")
                        self._abort()
                    if reply.error is not None:
                        call.errors[rank] = reply.error.to_exception(rank)
                    call.results[rank] = value
                    call.waiting.remove(rank)
                with self._pending_lock:
                    self._pending.popleft()
                if call.errors:
                    # A rank that died mid-collective makes the others' collectives fail (the
                    # peer reset the connection); their error may arrive before the monitor
                    # sees the death. The death is the cause: report it.
                    dead = None if self._closing else self._exited_rank(
                        _DEATH_GRACE_S if self.world_size > 1 else 0.0)
                    if dead is not None:
                        self._fail_rank_died(dead)
                        settle(call.future, error=EngineDeadError(self._dead))
                        self._abort()
                    settle(call.future, error=call.errors[min(call.errors)])
                elif call.reply_rank == ALL_RANKS:
                    settle(call.future, [call.results[r] for r in range(self.world_size)])
                else:
                    settle(call.future, call.results[call.reply_rank])
        except EngineDeadError:
            self._fail_pending()
            raise
        finally:
            self._reply_lock.release()

    def _exited_rank(self, grace: float) -> int | None:
        """The lowest rank whose process has exited, waiting up to `grace` seconds for one to
        show; None if every rank is still alive then."""
        deadline = time.monotonic() + grace
        while True:
            dead = [r for r, proc in enumerate(self._procs) if not proc.is_alive()]
            if dead or time.monotonic() >= deadline:
                return dead[0] if dead else None
            time.sleep(0.01)

    def collective_rpc(self, method: str | Callable, args: tuple = (),
                       timeout: float | None = None) -> list[Any]:
        """`method(*args)` on every worker (a callable runs as `method(worker, *args)`, sent
        pickled: keep it off the step path); one result per rank."""
        deadline = None if timeout is None else time.monotonic() + timeout
        future = self._submit(method, args, ALL_RANKS, timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return future.result(left)

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False
                      ) -> Future[None] | None:
        future = self._submit("execute_model", (scheduler_output,), self.output_rank)
        return future if non_block else future.result()

    def sample_tokens(self, grammar_output: GrammarOutput | None, non_block: bool = False
                      ) -> Future[ModelRunnerOutput] | ModelRunnerOutput:
        future = self._submit("sample_tokens", (grammar_output,), self.output_rank)
        return future if non_block else future.result()

    def initialize(self) -> int:
        try:
            num_blocks = super().initialize()
            # A worker process holds this engine for its whole life (executor/heap.py).
            self.collective_rpc(_freeze_worker_heap)
            return num_blocks
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        with self._state_lock:
            if self._closing:
                return
            self._closing = True
            healthy = self._dead is None
            if healthy:
                self._dead = "the executor was shut down"
        if healthy and self._requests is not None and self._send_lock.acquire(timeout=1.0):
            try:
                self._requests.enqueue(self._encoder.encode(
                    RPCCall(-1, SHUTDOWN_METHOD, (), NO_REPLY)), timeout=0.5)
            except Exception:  # a full ring or a dead worker: the pipes and signals remain
                pass
            finally:
                self._send_lock.release()
        if self._death_w is not None:
            self._death_w.close()
        self._wake_w.close()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(5.0)
        self._stop_workers(grace=_STOP_GRACE_S)
        self._fail_pending()
        for queue in self._responses:
            queue.close()
        if self._requests is not None:
            self._requests.close()
        for name in self._response_names:
            unlink_segment(name)
        self._wake_r.close()


def _freeze_worker_heap(worker: object) -> None:
    from executor.heap import freeze_startup_objects

    freeze_startup_objects()
