"""One engine step's round trip through an executor, Ray's against the multiprocess one, in
the same run: `execute_model` (a SchedulerOutput of 256 decode requests) then
`sample_tokens` (the ModelRunnerOutput for them), to one worker without a model
(shm_queue_workload.TwoPhaseEchoWorker). mp and ray carry the step the same way (the
shared-memory queue); the Ray worker is an actor on a one-node cluster on 127.0.0.1 that the
executor starts. ray-zmq places the actor as if on another node (RemoteRankRayExecutor): its
calls and replies take the ZMQ channels over TCP on 127.0.0.1. extra_info: p50/p99, and
`p50_over_mp` (the case's median over the multiprocess executor's, same run)."""

from __future__ import annotations

import os
import statistics
from functools import partial

import pytest

# Ray reads this when imported: keep the cluster the executor starts on 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from executor.multiproc import MultiprocExecutor  # noqa: E402
from executor.ray_executor import RayExecutor  # noqa: E402
from mrv2.engine.arg_utils import EngineArgs  # noqa: E402
from shm_queue_workload import decode_step, runner_output  # noqa: E402

NUM_REQS = 256
ROUNDS = 500


class RemoteRankRayExecutor(RayExecutor):
    """The Ray executor with its one rank as if on another node than the engine core."""

    def _is_local(self, rank: int) -> bool:
        return False


_EXECUTORS = {"mp": MultiprocExecutor, "ray": RayExecutor, "ray-zmq": RemoteRankRayExecutor}
_P50: dict[str, float] = {}


@pytest.mark.parametrize("backend", list(_EXECUTORS))
def test_step_round_trip(benchmark, backend):
    from mrv2.testing import default_demo_model_path

    if benchmark.disabled and backend != "mp":
        pytest.skip("timed only: the suite runs Ray ranks, over ZMQ too, in tests/executor/"
                    "test_ray_executor.py")
    benchmark.group = f"executor-step-round-trip-{NUM_REQS}"
    config = EngineArgs(model=str(default_demo_model_path()), distributed_executor_backend=(
        backend.split("-")[0])).create_engine_config()
    executor = partial(_EXECUTORS[backend],
                       worker_cls="shm_queue_workload:TwoPhaseEchoWorker")(config)
    sched = decode_step(NUM_REQS)
    expected = runner_output(sched)

    def step():
        executor.execute_model(sched, non_block=True)
        return executor.sample_tokens(None)

    try:
        assert step() == expected
        rounds = 1 if benchmark.disabled else ROUNDS
        assert benchmark.pedantic(step, rounds=rounds, warmup_rounds=0 if benchmark.disabled
                                  else 20) == expected
    finally:
        executor.shutdown()
    if benchmark.disabled:
        return
    data = sorted(benchmark.stats.stats.data)
    p50 = _P50[backend] = statistics.median(data)
    info = {"p50_us": round(p50 * 1e6, 1), "p99_us": round(data[int(0.99 * (len(data) - 1))]
                                                           * 1e6, 1), "num_reqs": NUM_REQS}
    if backend != "mp" and "mp" in _P50:
        info["p50_over_mp"] = round(p50 / _P50["mp"], 2)
    benchmark.extra_info.update(info)
