"""Offline throughput with prefix caching on vs off, on the tiny model, in the same run.

- 0% hit rate: every round sends fresh random prompts, so caching only costs (hashing and
  registering each full block). The ratio on/off is the overhead; the target is < 1%.
- High hit rate: every prompt starts with the same long prefix (cached after the warm-up
  round) followed by a short fresh suffix. The ratio on/off is the saving.

Compare the two cases of a group with each other (a ratio), never with another day's numbers.
The tiny model makes the forward pass cheap, so the hashing overhead is, if anything,
overstated relative to a real model. Torch runs on one thread here: on a shared 2-core machine
a multi-threaded forward turns any other load into multi-second outliers. Because whole-run
timings stay noisy at the 1% level, each case also records the CPU time spent inside the KV
cache manager in the last round (`kv_manager_s`): its difference on vs off is the overhead,
measured directly. On a loaded machine, `--benchmark-timer=time.process_time` (CPU time, one
torch thread) is steadier than wall time.
"""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_model

NUM_PROMPTS = 32
PROMPT_LEN = 512
SHARED_PREFIX_LEN = 480
MAX_TOKENS = 16
BLOCK_SIZE = 16
ROUNDS = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("bench-models") / "llama"))


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Timed:
    """Wraps the KV cache manager's per-step entry points and sums their CPU time (thread
    time: a descheduled thread, common on a shared machine, does not count)."""

    def __init__(self, manager, names=("get_computed_blocks", "allocate_slots", "free")):
        self.total = 0.0
        for name in names:
            setattr(manager, name, self._wrap(getattr(manager, name)))

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.thread_time() - start
        return timed


def _prompts(seed: int, prefix: list[int]) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": prefix + [rng.randrange(3, 2000)
                                           for _ in range(PROMPT_LEN - len(prefix))]}
            for _ in range(NUM_PROMPTS)]


def _run(benchmark, model_dir: str, caching: bool, prefix: list[int]) -> None:
    llm = LLM(model_dir, max_model_len=1024, block_size=BLOCK_SIZE,
              enable_prefix_caching=caching)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seeds = itertools.count()  # fresh suffixes every round, the same sequence on and off
    scheduler = llm.llm_engine.engine_core.scheduler
    stats = scheduler.prefix_cache_stats
    timed = _Timed(scheduler.kv_cache_manager)

    def setup():
        stats.reset()  # so the stats describe the last (timed) round
        timed.total = 0.0
        return (_prompts(next(seeds), prefix),), {}

    benchmark.pedantic(lambda prompts: llm.generate(prompts, params, use_tqdm=False),
                       setup=setup, rounds=ROUNDS, warmup_rounds=1)
    benchmark.extra_info.update(
        kv_manager_s=round(timed.total, 6),
        prefix_caching=caching, num_prompts=NUM_PROMPTS, prompt_len=PROMPT_LEN,
        shared_prefix_len=len(prefix), max_tokens=MAX_TOKENS, block_size=BLOCK_SIZE,
        hit_rate=round(stats.hit_rate, 4),
        tokens_per_round=NUM_PROMPTS * (PROMPT_LEN + MAX_TOKENS))
    if caching:
        assert (stats.hits > 0) == bool(prefix)


@pytest.mark.parametrize("caching", [False, True], ids=["off", "on"])
def test_zero_hit_rate(benchmark, model_dir, caching):
    benchmark.group = "prefix-caching-0pct-hits"
    _run(benchmark, model_dir, caching, prefix=[])


@pytest.mark.parametrize("caching", [False, True], ids=["off", "on"])
def test_high_hit_rate(benchmark, model_dir, caching):
    benchmark.group = "prefix-caching-high-hits"
    prefix = [random.Random("shared prefix").randrange(3, 2000) for _ in range(SHARED_PREFIX_LEN)]
    _run(benchmark, model_dir, caching, prefix=prefix)
