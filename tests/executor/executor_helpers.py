"""Executor state that only tests read, and worker RPCs that tests send."""

from __future__ import annotations

import gc
import os
import time

from executor.multiproc import MultiprocExecutor


def is_failed(executor: MultiprocExecutor) -> bool:
    """True once a worker died or the executor was shut down."""
    return executor._dead is not None


def worker_pids(executor: MultiprocExecutor) -> list[int]:
    return [proc.pid for proc in executor._procs]


def shm_names(executor: MultiprocExecutor) -> list[str]:
    """The shared-memory segments the executor's queues use (/dev/shm/<name> on Linux): the
    broadcast's (a RankBroadcast's local queue, when it has one) and the replies'."""
    requests = executor._requests
    shm = getattr(requests, "local", requests)
    return [*([] if shm is None else [shm.name]), *executor._response_names]


def frozen_object_count(_worker: object = None) -> int:
    """Objects in the permanent generation (0 until a freeze); callable as a worker RPC (sent
    pickled by reference: the worker imports this module from the parent's sys.path)."""
    return gc.get_freeze_count()


def output_rank_rpc(executor: MultiprocExecutor, method, args: tuple = ()):
    """`method` on every worker, waiting for the output rank's reply alone (as execute_model
    and sample_tokens do), its result."""
    return executor._submit(method, args, executor.output_rank).result()


def fail_on_rank_0_then_die_on_rank_1(worker: object, delay_s: float) -> None:
    """A worker RPC: rank 0 raises at once; rank 1 exits `delay_s` later (as a rank killed
    mid-collective, whose peers' errors reach the executor before its death shows)."""
    if worker.rank == 0:
        raise RuntimeError("a collective's peer reset the connection")
    time.sleep(delay_s)
    os._exit(1)


def stage_of(worker: object) -> tuple[int, int, int]:
    """A worker RPC: (first layer, end layer) of its pipeline stage, and how many of its
    runner's layer KV caches have storage."""
    held = worker.held_layers
    return held.start, held.stop, sum(1 for c in worker.runner.kv_caches if c.numel())


def pool_sizes(_worker: object = None) -> tuple[int, int]:
    """A worker RPC: the size numba's pool was made with and torch's intra-op thread count."""
    import numba
    import torch

    return numba.config.NUMBA_NUM_THREADS, torch.get_num_threads()
