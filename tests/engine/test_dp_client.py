"""Data parallelism: AsyncLLM over two engine cores (DPAsyncClient) gives each request the
single engine's tokens, spreads concurrent requests over both cores, aborts at the right core,
answers utilities from both, and fails as a whole, within 5 s, when one core dies. The
routing rule and the merged stats without processes."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from mrv2 import LLM
from mrv2.engine.arg_utils import EngineArgs
from mrv2.engine.async_llm import AsyncLLM
from mrv2.engine.dp_client import DPAsyncClient, merged_stats
from mrv2.errors import EngineDeadError
from mrv2.outputs import RequestOutputKind
from mrv2.protocol import CoreStats
from mrv2.sampling_params import SamplingParams

ARGS = dict(max_model_len=256, max_num_seqs=8, device="cpu")
PROMPTS = ["hello world", "def fibonacci(n):", "the quick brown fox", "import os"] * 2


def greedy(max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def _tokens(llm: AsyncLLM, prompt: str, params: SamplingParams, request_id: str):
    last = None
    async for output in llm.generate(prompt, params, request_id,
                                     RequestOutputKind.FINAL_ONLY):
        last = output
    return last.outputs[0].token_ids


def test_two_cores_serve_concurrent_requests_and_fail_together(tiny_llama):
    """Two cores (one AsyncLLM, to spare a second start-up): the single engine's tokens, half
    of the requests on each, aborts at the holder, utilities on both; then one core killed
    mid-generation fails every caller within 5 s."""
    local = LLM(str(tiny_llama), **ARGS)
    want = [o.outputs[0].token_ids for o in local.generate(PROMPTS, greedy(), use_tqdm=False)]
    local.shutdown()

    async def run():
        llm = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_llama), data_parallel_size=2,
                                                   **ARGS))
        client = llm.engine_core
        try:
            assert isinstance(client, DPAsyncClient) and len(client.clients) == 2
            assert len({c.proc.pid for c in client.clients}) == 2
            # Both cores busy: each takes half of the concurrent requests (seen mid-flight).
            for c in client.clients:
                os.kill(c.proc.pid, signal.SIGSTOP)
            tasks = [asyncio.create_task(_tokens(llm, p, greedy(), f"r{i}"))
                     for i, p in enumerate(PROMPTS)]
            await asyncio.sleep(0.3)
            assert client._load == [4, 4]
            for c in client.clients:
                os.kill(c.proc.pid, signal.SIGCONT)
            assert await asyncio.gather(*tasks) == want
            per_engine = await llm.get_engine_stats()
            assert len(per_engine) == 2 and all(s.num_kv_blocks for s in per_engine)
            assert (await llm.get_stats()).num_kv_blocks == sum(s.num_kv_blocks
                                                                 for s in per_engine)
            assert client._load == [0, 0] and not client._owner
            # Aborts go to the core that holds the request; utilities reach both.
            stream = llm.generate(PROMPTS[0], greedy(200), "long")
            await anext(stream)
            await llm.abort("long")
            assert client._load == [0, 0]
            assert await llm.reset_prefix_cache() is True
            # One core dies with requests on both (stopped: every one unfinished): every
            # caller fails, within 5 s.
            for c in client.clients:
                os.kill(c.proc.pid, signal.SIGSTOP)
            tasks = [asyncio.create_task(_tokens(llm, p, greedy(200), f"k{i}"))
                     for i, p in enumerate(PROMPTS[:4])]
            await asyncio.sleep(0.3)
            assert client._load == [2, 2]
            killed = time.monotonic()
            os.kill(client.clients[1].proc.pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True),
                                             10)
            assert time.monotonic() - killed < 5
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert "data-parallel engine 1" in str(results[0])
            assert llm.errored
            with pytest.raises(EngineDeadError):
                await anext(llm.generate(PROMPTS[0], greedy(), "late"))
        finally:
            os.kill(client.clients[0].proc.pid, signal.SIGCONT)
            llm.shutdown()

    asyncio.run(run())


def test_the_offline_llm_runs_one_engine(tiny_llama):
    from mrv2.config import ConfigError

    with pytest.raises(ConfigError, match="data_parallel_size=2"):
        LLM(str(tiny_llama), data_parallel_size=2, **ARGS)


def _stats(running: int, waiting: int, usage: float, blocks: int, spec=()) -> CoreStats:
    return CoreStats(num_running=running, num_waiting=waiting, num_unfinished=running + waiting,
                     has_unfinished=bool(running + waiting), kv_cache_usage=usage,
                     num_free_blocks=int(blocks * (1 - usage)), num_kv_blocks=blocks,
                     num_preemptions=running, prefix_cache_queries=10, prefix_cache_hits=4,
                     spec_decode=list(spec))


def test_merged_stats_sum_the_cores_and_weigh_kv_usage_by_blocks():
    merged = merged_stats([_stats(2, 1, 0.5, 100, [1, 2, 3]), _stats(1, 0, 0.0, 300, [1, 0, 1])])
    assert (merged.num_running, merged.num_waiting, merged.num_unfinished) == (3, 1, 4)
    assert merged.kv_cache_usage == 0.125 and merged.num_kv_blocks == 400
    assert merged.prefix_cache_queries == 20 and merged.spec_decode == [2, 2, 4]


def test_routing_takes_the_least_loaded_core_then_the_emptier_cache():
    client = object.__new__(DPAsyncClient)  # the rule alone, without core processes
    client.clients, client._load, client._kv_usage = [None] * 3, [2, 1, 1], [0.0, 0.5, 0.2]
    assert client.route() == 2
    client._load = [0, 0, 0]
    client._kv_usage = [0.0, 0.0, 0.0]
    assert client.route() == 0
