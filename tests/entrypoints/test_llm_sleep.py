"""LLM.sleep / wake_up (vLLM's sleep mode): level 1 frees the KV cache's memory, level 2 the
weights too; waking restores both and the same greedy output."""

from __future__ import annotations

import os

import pytest

from mrv2 import LLM, SamplingParams

KV_GB = 0.25
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 30)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # The pool is the smaller of the budget and what max_num_seqs full-length requests need:
    # 1024 x 512 tokens, 256 MiB for this model, 128 MiB per layer. Each layer's cache must be
    # above glibc's largest mmap threshold (32 MiB), or a process whose threshold grew would
    # take it from the heap, where a free need not lower the RSS.
    return LLM(str(tiny_llama), max_model_len=512, max_num_seqs=1024, kv_cache_memory_gb=KV_GB)


def kv_gb(llm: LLM) -> float:
    caches = llm.llm_engine.engine_core.executor.worker.runner.kv_caches
    return sum(c.numel() * c.element_size() for c in caches) / (1 << 30)


def tokens(llm: LLM) -> list[int]:
    return list(llm.generate("def main():", GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_level_1_frees_the_kv_cache_and_wakes_up_the_same(llm):
    expected = tokens(llm)
    cache = kv_gb(llm)
    assert cache >= 0.2  # big enough to see in the RSS
    awake = rss_gb()
    llm.sleep(level=1)
    try:
        asleep = rss_gb()
        assert llm.llm_engine.is_sleeping()
        with pytest.raises(ValueError, match="asleep"):
            llm.generate("x", GREEDY, use_tqdm=False)
    finally:
        llm.wake_up()
    # The KV cache was zeroed at start-up, so all of it was resident.
    assert awake - asleep > 0.9 * cache, (awake, asleep, cache)
    assert not llm.llm_engine.is_sleeping()
    assert rss_gb() - asleep > 0.9 * cache and kv_gb(llm) == cache
    assert tokens(llm) == expected


def test_level_2_drops_the_weights_and_reloads_them(llm):
    expected = tokens(llm)
    worker = llm.llm_engine.engine_core.executor.worker
    llm.sleep(level=2)
    try:
        assert worker.model is None and worker.runner.model is None
    finally:
        llm.wake_up()
    assert worker.model is not None and tokens(llm) == expected


def test_sleep_needs_an_idle_engine_and_a_valid_level(llm):
    engine = llm.llm_engine
    engine.add_request("busy", "hello", GREEDY)
    with pytest.raises(RuntimeError, match="idle"):
        llm.sleep()
    engine.abort_request("busy")
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags=["weights"])
    assert not engine.is_sleeping() and tokens(llm)
