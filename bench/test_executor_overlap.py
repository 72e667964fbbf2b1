"""Engine steps per second through the multiprocess executor, with the worker's phase 2
overlapped (its output resolved on the executor's reply thread while the worker receives and
runs step N+1) against the same worker resolving phase 2 before it replies
(executor_overlap_workload.BlockingPhase2Worker), in the same run.

Workload: 32 requests of 16 prompt tokens decoding 64 tokens each on the demo model (hidden 256,
4 layers: a cheap forward, so the host-side step path is a large share), async scheduling on.
extra_info: steps_per_s for the case, and overlap_over_blocking in the second case's run.
"""

from __future__ import annotations

import time
from functools import partial

import pytest
import torch

from executor.multiproc import MultiprocExecutor
from mrv2.core.engine_core import EngineCore
from mrv2.engine.arg_utils import EngineArgs
from mrv2.protocol import EngineCoreRequest
from mrv2.sampling_params import SamplingParams

NUM_REQS, PROMPT_LEN = 32, 16
_RESULTS: dict[str, float] = {}
_WORKERS = {"overlapped": "mrv2.worker:Worker",
            "blocking": "executor_overlap_workload:BlockingPhase2Worker"}


def _run(core: EngineCore, output_len: int) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(NUM_REQS):
        prompt = [(7 * i + j) % 200 + 10 for j in range(PROMPT_LEN)]
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, None, time.monotonic()))
    steps = 0
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    return steps


@pytest.mark.parametrize("worker", ["blocking", "overlapped"])
def test_multiproc_steps_per_second(benchmark, worker):
    from mrv2.testing import default_demo_model_path

    if benchmark.disabled and worker == "blocking":
        pytest.skip("the baseline is only timed; the suite's untimed pass runs the real worker")
    benchmark.group = "executor-overlap-demo-32x64"
    torch.set_num_threads(1)  # the worker process takes the machine's threads
    output_len = 4 if benchmark.disabled else 64
    config = EngineArgs(model=str(default_demo_model_path()), dtype="float32", max_model_len=128,
                        max_num_seqs=NUM_REQS, seed=0,
                        distributed_executor_backend="mp").create_engine_config()
    core = EngineCore(config, executor_class=partial(MultiprocExecutor,
                                                     worker_cls=_WORKERS[worker]))
    try:
        _run(core, 2)  # first steps: caches, allocator
        steps = {}

        def run() -> None:
            start = time.perf_counter()
            steps["n"] = _run(core, output_len)
            steps["s"] = time.perf_counter() - start

        benchmark.pedantic(run, rounds=3, warmup_rounds=0)
    finally:
        core.shutdown()
    rate = steps["n"] / steps["s"]
    _RESULTS[worker] = benchmark.stats.stats.median if not benchmark.disabled else steps["s"]
    benchmark.extra_info.update(steps_per_s=rate, num_reqs=NUM_REQS, output_len=output_len)
    if worker == "overlapped" and "blocking" in _RESULTS:
        benchmark.extra_info["overlap_over_blocking"] = _RESULTS["blocking"] / _RESULTS[worker]
