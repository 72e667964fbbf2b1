"""LLM.sleep / wake_up (vLLM's sleep mode): level 1 frees the KV cache's memory, level 2 the
weights too; waking restores both and the same greedy output."""

from __future__ import annotations

import os

import numpy as np
import pytest

from mrv2 import LLM, SamplingParams

KV_GB = 0.25
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_gb(ranges: list[tuple[int, int]]) -> float:
    """Resident memory inside the given (address, bytes) ranges, page by page from
    /proc/self/pagemap (bit 63: present). Unlike the process's RSS, nothing else the process
    allocates or frees meanwhile (the allocator's arenas, a thread's stack) moves it."""
    present = 0
    with open("/proc/self/pagemap", "rb") as f:
        for address, nbytes in ranges:
            first, last = address // PAGE, (address + nbytes - 1) // PAGE
            f.seek(first * 8)
            entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
            present += int(np.count_nonzero(entries >> np.uint64(63)))
    return present * PAGE / (1 << 30)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # The pool is the smaller of the budget and what max_num_seqs full-length requests need:
    # 1024 x 512 tokens, 256 MiB for this model, 128 MiB per layer. Each layer's cache must be
    # above glibc's largest mmap threshold (32 MiB), or a process whose threshold grew would
    # take it from the heap, where a free need not lower the RSS.
    return LLM(str(tiny_llama), max_model_len=512, max_num_seqs=1024, kv_cache_memory_gb=KV_GB)


def kv_ranges(llm: LLM) -> list[tuple[int, int]]:
    caches = llm.llm_engine.engine_core.executor.worker.runner.kv_caches
    return [(c.data_ptr(), c.numel() * c.element_size()) for c in caches]


def kv_gb(llm: LLM) -> float:
    return sum(nbytes for _, nbytes in kv_ranges(llm)) / (1 << 30)


def tokens(llm: LLM) -> list[int]:
    return list(llm.generate("def main():", GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_level_1_frees_the_kv_cache_and_wakes_up_the_same(llm):
    expected = tokens(llm)
    cache, ranges = kv_gb(llm), kv_ranges(llm)
    assert cache >= 0.2
    # The KV cache was zeroed at start-up, so all of it is resident.
    assert resident_gb(ranges) > 0.99 * cache
    llm.sleep(level=1)
    try:
        # Given back to the system, not to a heap that keeps the pages: nothing of the old
        # ranges stays resident (a little slack in case a new mapping reused an address).
        assert resident_gb(ranges) < 0.02 * cache
        assert llm.llm_engine.is_sleeping()
        with pytest.raises(ValueError, match="asleep"):
            llm.generate("x", GREEDY, use_tqdm=False)
    finally:
        llm.wake_up()
    assert not llm.llm_engine.is_sleeping()
    assert kv_gb(llm) == cache and resident_gb(kv_ranges(llm)) > 0.99 * cache
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


def test_level_1_frees_a_kv_cache_the_c_heap_holds(tiny_llama):
    """With mmap off (MALLOC_MMAP_MAX_=0), glibc serves every block from the heap, as it does
    a large one when enough freed memory lies there in a long process: freeing it keeps the
    pages resident unless the worker trims the heap (Worker.sleep does)."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent(f"""
        from mrv2 import LLM
        from tests.entrypoints.test_llm_sleep import kv_gb, kv_ranges, resident_gb
        llm = LLM({str(tiny_llama)!r}, max_model_len=512, max_num_seqs=1024,
                  kv_cache_memory_gb={KV_GB})
        cache, ranges = kv_gb(llm), kv_ranges(llm)
        before = resident_gb(ranges)
        llm.sleep(level=1)
        print(cache, before, resident_gb(ranges))
    """)
    env = dict(os.environ, MALLOC_MMAP_MAX_="0")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    cache, before, after = map(float, done.stdout.split()[-3:])
    assert before > 0.99 * cache and after < 0.02 * cache
