"""The worker process: start-up handshake, the RPC loop, and the death pipe.

`worker_main` runs in each spawned process. It builds the worker (`worker_cls`, a
"module:Class" string, constructed with the engine config and, when its constructor takes
them, its `rank`, `local_rank` and the `distributed_init_method` where the tensor-parallel
ranks meet; the worker joins that group in `load_model`), attaches to the parent's broadcast
queue as reader `rank`, creates its own reply queue, and reports `Ready` (with the reply
queue's handle, or the start-up traceback) over a pipe. On the way out it calls the worker's
`close()`, if it has one (which leaves the process group). Then it runs calls in order until a
shutdown message, a closed queue, or the parent's death. A thread blocks on the read end of the
death pipe: the parent holds the only write end, so EOF there means the parent is gone.
"""

from __future__ import annotations

import importlib
import inspect
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import traceback
from typing import TYPE_CHECKING, Any, Callable

from executor.deferred import OrderedReplies
from executor.process import report_ready, watch_parent
from executor.serial import (ALL_RANKS, SHUTDOWN_METHOD, MethodTypes, MsgpackEncoder, Ready,
                             RemoteError, RPCReply)
from executor.shm_queue import ShmQueueClosed, ShmQueueHandle, ShmQueueReader, ShmQueueWriter

if TYPE_CHECKING:  # names for type checkers only: executor imports nothing from mrv2
    from mrv2.config import EngineConfig

_PARENT_GONE_GRACE_S = 2.0


def import_object(qualified: str) -> Any:
    module, _, name = qualified.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


class _ParentGone(Exception):
    pass


def make_worker(worker_cls: str, config: EngineConfig, rank: int,
                distributed_init_method: str | None) -> Any:
    """`worker_cls(config, rank=..., local_rank=..., distributed_init_method=...)`, passing only
    the keywords its constructor accepts (a test double may take the config alone)."""
    cls = import_object(worker_cls)
    offered = {"rank": rank, "local_rank": rank,
               "distributed_init_method": distributed_init_method}
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if takes_any or k in params}
    return cls(config, **kwargs)


def shm_queues(rpc: ShmQueueHandle, reader: int, queue_shape: tuple[int, int]
               ) -> tuple[ShmQueueReader, ShmQueueWriter]:
    """Reader `reader` of the broadcast queue `rpc`, and a reply queue of its own; on failure
    nothing is left open."""
    requests = ShmQueueReader(rpc, reader)
    try:
        return requests, ShmQueueWriter(1, *queue_shape)
    except BaseException:
        requests.close()
        raise


def open_worker(rank: int, config: EngineConfig, worker_cls: str,
                open_queues: Callable[[], tuple[Any, Any]],
                distributed_init_method: str | None = None) -> tuple[Any, Any, Any]:
    """The worker of `rank`, then its (calls' reader, replies' writer) from `open_queues`."""
    worker = make_worker(worker_cls, config, rank, distributed_init_method)
    return (worker, *open_queues())


def serve_worker(rank: int, worker: Any, requests: ShmQueueReader, responses: ShmQueueWriter,
                 parent_gone: threading.Event) -> None:
    """Run calls in order until a shutdown message, a closed queue or `parent_gone`; then close
    the queues and the worker (which leaves the process group)."""
    try:
        _serve(rank, worker, requests, responses, parent_gone)
    finally:
        requests.close()
        responses.close()
        close = getattr(worker, "close", None)
        if close is not None and not parent_gone.is_set():
            try:
                close()
            except Exception:  # exiting anyway
                traceback.print_exc()


def worker_main(rank: int, config: EngineConfig, worker_cls: str, rpc: ShmQueueHandle,
                queue_shape: tuple[int, int], ready_conn: multiprocessing.connection.Connection,
                death_conn: multiprocessing.connection.Connection,
                distributed_init_method: str | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    parent_gone = threading.Event()
    watch_parent(death_conn, parent_gone.set, _PARENT_GONE_GRACE_S, name="mrv2-death-pipe")
    try:
        worker, requests, responses = open_worker(
            rank, config, worker_cls, lambda: shm_queues(rpc, rank, queue_shape),
            distributed_init_method)
        report_ready(ready_conn, Ready(rank, os.getpid(), response=responses.handle))
    except BaseException:
        error = traceback.format_exc()
        report_ready(ready_conn, Ready(rank, os.getpid(), error=error), error)
        sys.exit(1)
    finally:
        ready_conn.close()
    serve_worker(rank, worker, requests, responses, parent_gone)


def _serve(rank: int, worker: Any, requests: ShmQueueReader, responses: ShmQueueWriter,
           parent_gone: threading.Event) -> None:
    types, encoder = MethodTypes(type(worker)), MsgpackEncoder()
    # A phase-2 result may be Deferred (its output copy in flight): the reply thread waits for
    # it and replies, while this loop already runs the next call (step N+1's phase 1).
    replies = OrderedReplies(f"mrv2-worker-{rank}-replies")

    def abort() -> None:
        if parent_gone.is_set():
            raise _ParentGone

    def reply(call_id: int, result: Any, error: RemoteError | None) -> None:
        try:
            out = encoder.encode(RPCReply(call_id, rank, result, error))
        except Exception as e:  # the result cannot travel
            out = encoder.encode(RPCReply(call_id, rank, None, RemoteError.from_exception(
                e, traceback.format_exc())))
        try:
            responses.enqueue(out, abort=abort)
        except _ParentGone:
            pass  # the main loop sees it too and returns

    def sender(call_id: int, error: RemoteError | None):
        def send(result: Any, resolve_error: BaseException | None) -> None:
            if resolve_error is not None:
                text = "".join(traceback.format_exception(resolve_error))
                reply(call_id, None, RemoteError.from_exception(resolve_error, text))
            else:
                reply(call_id, result, error)
        return send

    while True:
        try:
            frames = requests.dequeue(abort=abort)
        except (ShmQueueClosed, _ParentGone):
            return
        call = types.decode_call(frames)
        if call.method == SHUTDOWN_METHOD:
            replies.drain(timeout=_PARENT_GONE_GRACE_S)
            return
        result = error = None
        try:
            args = types.decode_args(call, frames)
            if call.function is not None:
                result = pickle.loads(call.function)(worker, *args)
            elif call.method.startswith("_"):
                raise AttributeError(f"{call.method!r} is private: not callable over RPC")
            else:
                result = getattr(worker, call.method)(*args)
        except Exception as e:
            error = RemoteError.from_exception(e, traceback.format_exc())
        if call.reply_rank not in (ALL_RANKS, rank):
            if error is not None:
                # The parent expects nothing from this rank, so it cannot be told; the ranks
                # are out of step now. Exit: the monitor fails the executor.
                print(f"mrv2 worker rank {rank}: {call.method} failed and only rank "
                      f"{call.reply_rank} replies; exiting\n{error.traceback}", file=sys.stderr)
                sys.exit(1)
            continue
        replies.submit(result, sender(call.call_id, error))
        if parent_gone.is_set():
            return
