"""RayExecutor: the multiprocess executor's workers, as Ray actors placed across a cluster.

As vLLM's Ray executor now does, Ray only places and supervises the workers; the step's
messages take the multiprocess executor's path (executor/multiproc.py: one msgspec-encoded
broadcast, replies on one queue per rank, the two-phase `execute_model` / `sample_tokens`
contract), and the ranks form their torch.distributed groups (gloo on CPU, NCCL on CUDA) at
rank 0's node address. Ranks on the engine core's node read the broadcast from shared memory;
a rank on another node gets the same frames over a ZMQ channel each way
(executor/rank_broadcast.py, executor/zmq_channel.py).

Start-up: join the cluster, or start a local one on 127.0.0.1 (executor/ray_cluster.py); a
placement group of one bundle per rank; one `RayWorkerActor` per bundle
(executor/ray_worker.py), which builds its worker and attaches to the queue; then each
actor's `serve()` call runs its loop.

Failure: a monitor thread waits on the `serve()` calls. One that ends while the executor runs
(the actor was killed, its node lost, or its loop left) fails the executor as a dead worker
process does: every pending and later call raises `EngineDeadError`.

Shutdown: the shutdown message, then every actor is killed and the placement group removed,
so nothing of the engine stays on the cluster; a cluster this executor started is stopped.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from executor.errors import WorkerStartupError
from executor.multiproc import MultiprocExecutor
from executor.ray_cluster import (bundle_nodes, carried_env, import_ray, join_or_start,
                                  place_ranks)
from executor.rank_broadcast import RankBroadcast
from executor.ray_worker import RankChannel, RayWorkerActor
from executor.serial import Ready
from executor.shm_queue import DEFAULT_CHUNK_BYTES, DEFAULT_NUM_CHUNKS, ShmQueueReader
from executor.zmq_channel import ZmqReceiver, ZmqSender

if TYPE_CHECKING:  # names for type checkers only: executor imports nothing from mrv2
    from mrv2.config import EngineConfig

logger = logging.getLogger(__name__)

# How often the monitor looks at the workers' serve() calls, and so (with Ray's own notice of
# a dead actor, under a second) how soon a dead rank fails the engine.
_MONITOR_POLL_S = 0.2


class RayExecutor(MultiprocExecutor):
    def __init__(self, config: EngineConfig, *, worker_cls: str = "mrv2.worker:Worker",
                 num_chunks: int = DEFAULT_NUM_CHUNKS, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 startup_timeout_s: float = 300.0, placement_timeout_s: float = 120.0) -> None:
        self._ray = import_ray()
        self._started_cluster = False
        self._placement_timeout_s = placement_timeout_s
        self._group: Any = None
        self._actors: list[Any] = []
        self._serving: list[Any] = []  # each actor's serve() call (a Ray object ref)
        self._where: list[tuple[str, str, int, int]] = []  # node id, address, pid, free port
        super().__init__(config, worker_cls=worker_cls, num_chunks=num_chunks,
                         chunk_bytes=chunk_bytes, startup_timeout_s=startup_timeout_s)

    # -- start-up --------------------------------------------------------------------------------

    def _start_workers(self, worker_cls: str, queue_shape: tuple[int, int],
                       timeout: float) -> None:
        ray = self._ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._started_cluster = join_or_start()
        self._group = place_ranks(self.world_size, self.config.device,
                                  self._placement_timeout_s)
        actor_class = ray.remote(RayWorkerActor)
        device_key = "num_gpus" if self.config.device == "cuda" else "num_cpus"
        nodes, node_cpus = bundle_nodes(self._group)
        here = ray.get_runtime_context().get_node_id()
        for rank in range(self.world_size):
            # The ranks placed on one node share its cores (this node's budget is this
            # process's own, which may be a data-parallel engine core's share).
            node = nodes[rank]
            env = carried_env() | self._rank_env(
                nodes.count(node), None if node == here else node_cpus.get(node) or None)
            self._actors.append(actor_class.options(
                name=f"mrv2-worker-{rank}-{id(self):x}", **{device_key: 1},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=rank),
                runtime_env={"env_vars": env}).remote(list(sys.path)))
        deadline = time.monotonic() + timeout
        self._where = self._gather([a.where.remote() for a in self._actors], deadline, "where")
        if self.world_size > 1:
            _, address, _, port = self._where[0]
            self.distributed_init_method = f"tcp://{address}:{port}"
        channels, replies = self._open_channels(queue_shape)
        self._responses = list(replies.values())  # closed at shutdown, if start-up fails
        readies: list[Ready] = self._gather(
            [actor.start.remote(rank, self.config, worker_cls, channels[rank], queue_shape,
                                self.distributed_init_method)
             for rank, actor in enumerate(self._actors)], deadline, "start")
        for ready in readies:
            if ready.error is not None:
                raise WorkerStartupError(
                    f"worker rank {ready.rank} ({self._name(ready.rank)}) failed to start:\n"
                    f"{ready.error}", rank=ready.rank, remote_traceback=ready.error)
        self._response_names = [r.response.name for r in readies if r.response is not None]
        self._responses = [replies[rank] if ready.response is None
                           else ShmQueueReader(ready.response, 0)
                           for rank, ready in enumerate(readies)]
        self._serving = [actor.serve.remote() for actor in self._actors]

    def _is_local(self, rank: int) -> bool:
        """Whether rank `rank` runs on the engine core's node (and so reads shared memory)."""
        return self._where[rank][0] == self._ray.get_runtime_context().get_node_id()

    def _open_channels(self, queue_shape: tuple[int, int]
                       ) -> tuple[list[RankChannel], dict[int, ZmqReceiver]]:
        """Each rank's channel, the broadcast behind them (`_requests`), and the reply ends of
        the ranks on other nodes (bound here, on this node's address)."""
        local = [rank for rank in range(self.world_size) if self._is_local(rank)]
        host = self._ray.util.get_node_ip_address()
        senders = {rank: ZmqSender(bind_host=host) for rank in range(self.world_size)
                   if rank not in local}
        replies = {rank: ZmqReceiver(bind_host=host) for rank in senders}
        self._requests = RankBroadcast(len(local), list(senders.values()), *queue_shape)
        channels = [RankChannel(shm=self._requests.handle, reader=local.index(rank))
                    if rank in local else
                    RankChannel(requests=senders[rank].address, replies=replies[rank].address)
                    for rank in range(self.world_size)]
        if senders:
            logger.info("worker rank(s) %s run on other nodes: their calls go over ZMQ",
                        sorted(senders))
        return channels, replies

    def _gather(self, refs: list[Any], deadline: float, what: str) -> list[Any]:
        """Every call's result by `deadline`; a rank that died or stays silent fails start-up."""
        ray = self._ray
        done, waiting = ray.wait(refs, num_returns=len(refs),
                                 timeout=max(0.0, deadline - time.monotonic()))
        if waiting:
            ranks = [refs.index(ref) for ref in waiting]
            raise WorkerStartupError(f"worker rank(s) {ranks} did not answer {what}() before "
                                     f"the start-up timeout", rank=ranks[0])
        results = []
        for rank, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayError as e:
                raise WorkerStartupError(f"worker rank {rank} ({self._name(rank)}) died during "
                                         f"{what}(): {e}", rank=rank) from None
        return results

    def _name(self, rank: int) -> str:
        if rank < len(self._where):
            _, address, pid, _ = self._where[rank]
            return f"Ray actor, pid {pid} on node {address}"
        return "Ray actor"

    # -- failure ---------------------------------------------------------------------------------

    def _watch_workers(self) -> threading.Thread:
        def watch() -> None:
            while not self._closing:
                done, _ = self._ray.wait(self._serving, num_returns=1, timeout=_MONITOR_POLL_S)
                if done and not self._closing:
                    self._fail_rank_died(self._serving.index(done[0]))
                    return

        thread = threading.Thread(target=watch, name="mrv2-ray-worker-monitor", daemon=True)
        thread.start()
        return thread

    def _exit_text(self, rank: int, wait_s: float) -> str:
        ray = self._ray
        try:
            ray.get(self._serving[rank], timeout=wait_s)
            how = "left its loop"
        except ray.exceptions.GetTimeoutError:
            how = "stopped answering"
        except ray.exceptions.RayError as e:
            how = f"died ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        return f"worker rank {rank} ({self._name(rank)}) {how}"

    def _exited_rank(self, grace: float) -> int | None:
        if not self._serving:
            return None
        done, _ = self._ray.wait(self._serving, num_returns=1, timeout=grace)
        return self._serving.index(done[0]) if done else None

    def _stop_workers(self, grace: float) -> None:
        ray = self._ray
        if not ray.is_initialized():
            return
        if self._serving:
            ray.wait(self._serving, num_returns=len(self._serving), timeout=grace)
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._group)
            self._group = None

    def shutdown(self) -> None:
        super().shutdown()
        if self._started_cluster and self._ray.is_initialized():
            self._started_cluster = False
            self._ray.shutdown()
