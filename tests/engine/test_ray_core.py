"""Data-parallel engine cores as Ray actors (`data_parallel_backend="ray"`): AsyncLLM over
two core actors on a local cluster (started on 127.0.0.1 by the client, stopped at its
shutdown) gives the single engine's tokens, with requests on both cores; a killed core actor
fails every caller within 5 s; nothing is left after shutdown. ParallelConfig's refusals."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported
ray = pytest.importorskip("ray")

from mrv2 import LLM  # noqa: E402
from mrv2.config import ConfigError  # noqa: E402
from mrv2.engine.arg_utils import EngineArgs  # noqa: E402
from mrv2.engine.async_llm import AsyncLLM  # noqa: E402
from mrv2.engine.dp_client import DPAsyncClient  # noqa: E402
from mrv2.errors import EngineDeadError  # noqa: E402
from mrv2.parallel_config import ParallelConfig  # noqa: E402
from mrv2.testing.leftovers import process_alive  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_dp_client import ARGS, PROMPTS, _tokens, greedy  # noqa: E402


@pytest.fixture
def own_ray_tmpdir(monkeypatch):
    """A Ray temp dir of this test's own (short: Ray's socket paths must fit 107 bytes), so the
    client finds no cluster another test left running and starts its own."""
    path = tempfile.mkdtemp(prefix="mrv2-ray-")
    monkeypatch.setenv("RAY_TMPDIR", path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_two_core_actors_serve_concurrent_requests_and_fail_together(tiny_llama,
                                                                     own_ray_tmpdir):
    local = LLM(str(tiny_llama), **ARGS)
    want = [o.outputs[0].token_ids for o in local.generate(PROMPTS, greedy(), use_tqdm=False)]
    local.shutdown()
    assert not ray.is_initialized()

    async def run() -> list[int]:
        llm = AsyncLLM.from_engine_args(EngineArgs(
            model=str(tiny_llama), data_parallel_size=2, data_parallel_backend="ray", **ARGS))
        client = llm.engine_core
        pids = [c.process.pid for c in client.clients]
        try:
            assert isinstance(client, DPAsyncClient) and ray.is_initialized()
            assert len(set(pids)) == 2 and os.getpid() not in pids
            assert all(c.proc is None for c in client.clients)  # actors, not our children
            assert client.placement.bind_host == "127.0.0.1"
            # Both cores busy: each takes half of the concurrent requests (seen mid-flight).
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            tasks = [asyncio.create_task(_tokens(llm, p, greedy(), f"r{i}"))
                     for i, p in enumerate(PROMPTS)]
            await asyncio.sleep(0.3)
            assert client._load == [4, 4]
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            assert await asyncio.gather(*tasks) == want
            per_engine = await llm.get_engine_stats()
            assert len(per_engine) == 2 and all(s.num_kv_blocks for s in per_engine)
            # One core actor dies with requests on both: every caller fails within 5 s.
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            tasks = [asyncio.create_task(_tokens(llm, p, greedy(200), f"k{i}"))
                     for i, p in enumerate(PROMPTS[:4])]
            await asyncio.sleep(0.3)
            killed = time.monotonic()
            os.kill(pids[1], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True),
                                             10)
            assert time.monotonic() - killed < 5
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert "data-parallel engine 1" in str(results[0]) and "Ray actor" in str(results[0])
            assert llm.errored
        finally:
            os.kill(pids[0], signal.SIGCONT)
            llm.shutdown()
        return pids

    pids = asyncio.run(run())
    assert not ray.is_initialized()  # the client stopped the cluster it started
    deadline = time.monotonic() + 5
    while left := [pid for pid in pids if process_alive(pid)]:
        assert time.monotonic() < deadline, f"core actors still running: {left}"
        time.sleep(0.05)


def test_refusals_name_the_setting():
    with pytest.raises(ConfigError, match="data_parallel_backend='tcp'"):
        ParallelConfig(data_parallel_size=2, data_parallel_backend="tcp")
    with pytest.raises(ConfigError, match="distributed_executor_backend='mp'"):
        ParallelConfig(data_parallel_size=2, data_parallel_backend="ray",
                       distributed_executor_backend="ray")
