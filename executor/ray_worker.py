"""A worker rank inside a Ray actor: the multiprocess executor's worker loop, placed by Ray.

The actor is a plain class, made remote by the executor (executor/ray_executor.py), so that
importing this module does not import Ray. Its calls, in order:
- `where()`: its node id, node address, process id and a free port on its node (rank 0's is
  where the tensor-parallel group meets);
- `start(...)`: build the worker and open its `RankChannel`: on the engine core's node the
  broadcast queue (shared memory, as a spawned worker process reads it:
  executor/worker_proc.py) and a reply queue of its own; on another node a ZMQ channel each
  way (executor/zmq_channel.py). Returns `Ready` (the reply queue's handle, or the start-up
  traceback);
- `serve()`: run calls until the shutdown message or a closed channel. It blocks the actor;
  its result (or error, when the actor dies) is how the executor learns that the rank is gone.

Ray fate-shares a non-detached actor with the process that created it, so the actor does not
need the death pipe a spawned worker watches.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from executor.process import get_open_port
from executor.serial import Ready
from executor.shm_queue import ShmQueueHandle
from executor.worker_proc import open_worker, serve_worker, shm_queues
from executor.zmq_channel import ZmqReceiver, ZmqSender

if TYPE_CHECKING:  # names for type checkers only: executor imports nothing from mrv2
    from mrv2.config import EngineConfig


@dataclass(frozen=True)
class RankChannel:
    """How a rank hears the engine core: `shm` (the broadcast queue) as reader `reader`, or,
    on another node, ZMQ addresses to connect to: `requests` (calls in), `replies` (out)."""

    shm: ShmQueueHandle | None = None
    reader: int = 0
    requests: str | None = None
    replies: str | None = None

    def open(self, queue_shape: tuple[int, int]) -> tuple[Any, Any]:
        """(the calls' reader, the replies' writer)."""
        if self.shm is not None:
            return shm_queues(self.shm, self.reader, queue_shape)
        requests = ZmqReceiver(address=self.requests)
        try:
            return requests, ZmqSender(address=self.replies)
        except BaseException:
            requests.close()
            raise


class RayWorkerActor:
    def __init__(self, sys_path: list[str]) -> None:
        # As a spawned process gets its parent's sys.path: the engine's modules (and functions
        # sent by reference) import as they do there. Entries missing on this node are harmless.
        sys.path.extend(p for p in sys_path if p not in sys.path)
        self._rank = -1
        self._opened: tuple[Any, Any, Any] | None = None

    def where(self) -> tuple[str, str, int, int]:
        import ray

        address = ray.util.get_node_ip_address()
        return (ray.get_runtime_context().get_node_id(), address, os.getpid(),
                get_open_port(address))

    def start(self, rank: int, config: EngineConfig, worker_cls: str, channel: RankChannel,
              queue_shape: tuple[int, int], distributed_init_method: str | None) -> Ready:
        self._rank = rank
        # Ray sets OMP_NUM_THREADS to the bundle's CPU count (1) when the environment has none;
        # torch's pool takes numba's size instead: the share of the cores the executor gave
        # this rank (process_env), else the machine's cores, as a spawned worker would.
        import torch

        torch.set_num_threads(int(os.environ.get("NUMBA_NUM_THREADS")
                                  or len(os.sched_getaffinity(0))))
        try:
            self._opened = open_worker(rank, config, worker_cls, lambda: channel.open(queue_shape),
                                       distributed_init_method)
        except BaseException:
            return Ready(rank, os.getpid(), error=traceback.format_exc())
        return Ready(rank, os.getpid(), response=getattr(self._opened[2], "handle", None))

    def serve(self) -> None:
        if self._opened is None:
            raise RuntimeError(f"rank {self._rank}: serve() before a successful start()")
        worker, requests, responses = self._opened
        serve_worker(self._rank, worker, requests, responses, threading.Event())
