"""RayExecutor on a one-node Ray cluster on 127.0.0.1: started for the engine when none runs
(and stopped with it), or joined (from another process too); tensor-parallel ranks and
pipeline stages as actors give the single-process engine's greedy tokens; a killed actor
fails every caller with EngineDeadError within 5 s;
start-up failures (a worker's error, a placement the cluster cannot give) name what failed;
nothing of the engine is left on the cluster after shutdown.

`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` keeps the cluster on 127.0.0.1 (Ray would pick the
machine's other address). A cluster starts in seconds: the module shares one, and the first
test (which checks that the executor starts its own when none runs) runs before it exists."""

from __future__ import annotations

import dataclasses
import itertools
import json
import operator
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

# Read by Ray when it is imported (executor/ray_cluster.py): set before this module imports it.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray  # noqa: E402

from mrv2.engine.arg_utils import EngineArgs  # isort: skip
from executor.ray_executor import RayExecutor  # isort: skip
from mrv2 import LLM, SamplingParams
from mrv2.core.engine_core import EngineCore
from mrv2.errors import EngineDeadError, WorkerStartupError
from mrv2.parallel_config import ParallelConfig
from mrv2.protocol import EngineCoreRequest
from mrv2.testing.leftovers import process_alive
from mrv2.utils import free_cores

from executor_helpers import is_failed, pool_sizes, shm_names

PROMPTS = [[5, 17, 300, 42, 1000, 7, 8], [900, 33, 12, 1500, 64], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory):
    return tiny_model_factory("llama", num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def config(tiny_dir):
    return EngineArgs(model=str(tiny_dir), max_model_len=128,
                      distributed_executor_backend="ray").create_engine_config()


@pytest.fixture(scope="module", autouse=True)
def own_ray_tmpdir():
    """A Ray temp dir of this module's own (short: Ray's socket paths must fit 107 bytes): its
    engines find no cluster another test file left running, and its joining process finds
    this module's."""
    path = tempfile.mkdtemp(prefix="mrv2-ray-")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_TMPDIR", path)
        patch.delenv("RAY_ADDRESS", raising=False)
        yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(own_ray_tmpdir):
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=4, include_dashboard=False)
    # Announced as `ray start --head` announces one (its address file in the temp dir), so
    # another process finds it (an unannounced cluster is never joined: ray_cluster.py).
    announced = Path(own_ray_tmpdir) / "ray" / "ray_current_cluster"
    announced.parent.mkdir(exist_ok=True)
    announced.write_text(ray.get_runtime_context().gcs_address)
    yield
    announced.unlink(missing_ok=True)
    ray.shutdown()


def _pids(executor: RayExecutor) -> list[int]:
    return [pid for _, _, pid, _ in executor._where]


def _assert_nothing_left(executor: RayExecutor) -> None:
    deadline = time.monotonic() + 5
    while left := [pid for pid in _pids(executor) if process_alive(pid)]:
        assert time.monotonic() < deadline, f"worker actors still running: {left}"
        time.sleep(0.05)
    assert not [n for n in shm_names(executor) if os.path.exists(f"/dev/shm/{n}")]
    if ray.is_initialized():
        states = {g["name"]: g["state"] for g in ray.util.placement_group_table().values()}
        assert all(s == "REMOVED" for n, s in states.items() if n.startswith("mrv2-"))


def _generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_dir) -> list[list[int]]:
    llm = LLM(str(tiny_dir), max_model_len=128)  # one process
    try:
        return _generate(llm)
    finally:
        llm.shutdown()


def _add_requests(core: EngineCore, batch: int) -> None:
    for i, prompt in enumerate(PROMPTS):
        core.add_request(EngineCoreRequest(
            request_id=f"{batch}-{i}", prompt_token_ids=prompt, eos_token_id=None,
            sampling_params=GREEDY, arrival_time=0.0))


def test_starts_a_local_cluster_and_a_killed_actor_fails_every_caller_within_5_s(config):
    """With no cluster running, the executor starts one on 127.0.0.1 (and stops it at
    shutdown); killing its worker actor mid-generation fails the stepping thread, and every
    later call, with EngineDeadError within 5 s."""
    assert not ray.is_initialized()
    core = EngineCore(config)  # the backend picks RayExecutor
    executor = core.executor
    try:
        assert isinstance(executor, RayExecutor) and ray.is_initialized()
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        errors: list[BaseException] = []
        stop = time.monotonic() + 20

        def generate() -> None:  # batch after batch, until the engine fails
            batches = itertools.count()
            try:
                while time.monotonic() < stop:
                    if not core.has_unfinished_requests():
                        _add_requests(core, next(batches))
                    core.step()
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=generate)
        thread.start()
        time.sleep(1.0)
        killed = time.monotonic()
        ray.kill(executor._actors[0], no_restart=True)
        thread.join(10)
        assert time.monotonic() - killed < 5
        assert len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors
        assert "worker rank 0 (Ray actor" in str(errors[0])
        assert is_failed(executor)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            executor.collective_rpc("determine_num_kv_blocks")
        assert time.monotonic() - start < 1
    finally:
        core.shutdown()
    assert not ray.is_initialized()  # the executor stopped the cluster it started
    _assert_nothing_left(executor)


class RanksAsIfOnTwoNodes(RayExecutor):
    """Rank 0 on the engine core's node, every other rank as if on a second node: their calls
    and replies travel over ZMQ channels instead of shared memory (one node cannot hold a
    second Ray node on 127.0.0.1)."""

    def _is_local(self, rank: int) -> bool:
        return rank == 0


def test_a_rank_on_another_node_hears_the_engine_over_zmq(cluster, config, reference):
    """Two tensor-parallel ranks as actors, rank 1 as if on a second node: the single-process
    engine's tokens, each rank with half of the heads."""
    two = dataclasses.replace(config, parallel_config=ParallelConfig(
        tensor_parallel_size=2, distributed_executor_backend="ray"))
    core = EngineCore(two, executor_class=RanksAsIfOnTwoNodes)
    executor = core.executor
    try:
        assert len(executor._requests.remote) == 1 and len(executor._response_names) == 1
        assert len(set(_pids(executor))) == 2 and os.getpid() not in _pids(executor)
        assert executor.distributed_init_method.startswith("tcp://127.0.0.1:")
        heads = executor.collective_rpc(
            operator.attrgetter("model.model.layers.0.self_attn.num_heads"))
        assert heads == [2, 2]  # each rank holds half of the 4 heads
        # Both actors are on this node: each started with half of its cores in both pools.
        share = int(free_cores.pool_env(2)["NUMBA_NUM_THREADS"])
        assert executor.collective_rpc(pool_sizes) == [[share, share]] * 2  # msgspec: lists
        _add_requests(core, 0)
        tokens: dict[str, list[int]] = {}
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert [tokens[f"0-{i}"] for i in range(len(PROMPTS))] == reference
    finally:
        core.shutdown()
    assert ray.is_initialized()  # a joined cluster outlives the engine
    _assert_nothing_left(executor)


def test_another_process_joins_the_running_cluster_with_two_stages(cluster, tiny_dir,
                                                                     reference, tmp_path):
    """An engine in another process (as `mrv2 serve`'s engine core) finds the running cluster
    (as one `ray start` leaves) and places its two pipeline stages there."""
    script = tmp_path / "join.py"
    script.write_text(
        "import json, sys\nimport ray\nfrom mrv2 import LLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(tiny_dir)!r}, max_model_len=128, pipeline_parallel_size=2,\n"
        "              distributed_executor_backend='ray')\n"
        f"    prompts = [{{'prompt_token_ids': p}} for p in {PROMPTS!r}]\n"
        "    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)\n"
        "    out = llm.generate(prompts, params, use_tqdm=False)\n"
        "    print(json.dumps([ray.cluster_resources()['CPU'],\n"
        "                      [list(o.outputs[0].token_ids) for o in out]]))\n"
        "    llm.shutdown()\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    cpus, tokens = json.loads(result.stdout.strip().splitlines()[-1])
    assert cpus == 4  # this module's cluster, not one of its own
    assert tokens == reference


def test_a_workers_start_up_error_carries_its_traceback(cluster, config):
    bad = dataclasses.replace(config, device="nonsense")
    before = {g["name"] for g in ray.util.placement_group_table().values()}
    with pytest.raises(WorkerStartupError, match="worker rank 0 .* failed to start") as info:
        RayExecutor(bad)
    assert "nonsense" in info.value.remote_traceback
    groups = ray.util.placement_group_table().values()
    assert all(g["state"] == "REMOVED" for g in groups if g["name"] not in before)


def test_a_placement_the_cluster_cannot_give_names_what_it_asked_for(cluster, config):
    from ray.util.placement_group import placement_group, remove_placement_group

    two = dataclasses.replace(config, parallel_config=ParallelConfig(
        tensor_parallel_size=2, distributed_executor_backend="ray"))
    busy = placement_group([{"CPU": 3.0}])  # of the cluster's 4 CPUs, one stays free
    ray.get(busy.ready(), timeout=30)
    try:
        start = time.monotonic()
        with pytest.raises(WorkerStartupError, match=r"2 worker rank\(s\) within 1 s: they "
                           r"asked for a placement group of bundles \[\{'CPU': 1.0\}, "
                           r"\{'CPU': 1.0\}\] \(strategy PACK\); the cluster has"):
            RayExecutor(two, placement_timeout_s=1.0)
        assert time.monotonic() - start < 10
    finally:
        remove_placement_group(busy)
