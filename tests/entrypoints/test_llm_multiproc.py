"""LLM with worker processes (distributed_executor_backend="mp"): same tokens as in-process,
and a dead worker surfaces as EngineDeadError instead of a hang."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.config import ConfigError
from mrv2.errors import EngineDeadError
from mrv2.testing.leftovers import engine_leftovers, wait_for_no_leftovers

import executor_helpers

PROMPTS = [{"prompt_token_ids": [5 + i, 17, 300 + 7 * i, 42]} for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_mp_backend_matches_in_process_and_dies_loudly(tiny_llama):
    uni = LLM(str(tiny_llama), max_model_len=2048)
    want = [o.outputs[0].token_ids for o in uni.generate(PROMPTS, GREEDY, use_tqdm=False)]
    uni.llm_engine.shutdown()

    shm_before = set(os.listdir("/dev/shm"))
    llm = LLM(str(tiny_llama), max_model_len=2048, distributed_executor_backend="mp")
    executor = llm.llm_engine.engine_core.executor
    [pid] = pids = executor_helpers.worker_pids(executor)
    shm_names = executor_helpers.shm_names(executor)
    assert len(shm_names) == 2 and all(os.path.exists(f"/dev/shm/{n}") for n in shm_names)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == want

        # 8 requests of ~2000 tokens run for seconds; the worker dies early in that.
        killed_at: list[float] = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)

        killer = threading.Timer(0.5, kill)
        long = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
        killer.start()
        with pytest.raises(EngineDeadError, match=f"pid {pid}"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 8, long, use_tqdm=False)
        raised_at = time.monotonic()
        killer.join()
        assert killed_at and raised_at - killed_at[0] < 5.0
        # Nothing is left once the error is out, even before (or without) shutdown.
        wait_for_no_leftovers(pids, shm_names, shm_before)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):  # later calls fail at once
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 1.0
    finally:
        llm.llm_engine.shutdown()
    assert not engine_leftovers(pids, shm_names, shm_before)


def test_unknown_executor_backend(tiny_llama):
    with pytest.raises(ConfigError, match="distributed_executor_backend"):
        LLM(str(tiny_llama), distributed_executor_backend="external_launcher")
