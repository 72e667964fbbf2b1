"""EAGLE speculation (spec_decode/eagle.py) end to end: the target's tokens with and without
it. A mirror head (mrv2/testing/tiny_eagle.py) drafts the target's own tokens almost always,
so a catch-up that fed it the wrong positions, features or tokens (or lost its KV to a
missing lookahead block) shows as rejections; a random head's drafts are rejected."""

from __future__ import annotations

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.config import ConfigError
from mrv2.testing.tiny_eagle import make_eagle_head, mirror_ready_target
from tests.spec_decode.test_draft_model import ENGINE, PROMPTS, counters, greedy, tokens


def eagle(target, head, k: int = 3, **kwargs) -> LLM:
    return LLM(str(target), speculative_config={"method": "eagle", "model": str(head),
                                                "num_speculative_tokens": k},
               **{**ENGINE, **kwargs})


@pytest.fixture(scope="module")
def mirror_pair(tiny_model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target = mirror_ready_target(root / "target",
                                 tiny_model_factory("llama", num_layers=1, init_scale=4.0))
    return target, make_eagle_head(root / "head", target, mirror=True)


@pytest.fixture(scope="module")
def random_pair(tiny_model_factory, tmp_path_factory):
    target = tiny_model_factory("llama", init_scale=4.0)
    return target, make_eagle_head(tmp_path_factory.mktemp("eagle") / "head", target, seed=3,
                                   num_layers=2)


def test_a_mirror_head_drafts_the_targets_tokens(mirror_pair, rows_cost_little):
    """One request at a time, then together; prompts in chunks (the head follows each
    chunk's hidden states), drafts across block boundaries; the second round hits the prefix
    cache, whose blocks hold the head's KV from the first."""
    target, head = mirror_pair
    want = tokens(LLM(str(target), **ENGINE), greedy())
    llm = eagle(target, head)
    for _ in range(2):
        before = counters(llm)
        assert [tokens(llm, greedy(), [p])[0] for p in PROMPTS] == want
        assert tokens(llm, greedy()) == want
        drafted, accepted = (a - b for a, b in zip(counters(llm), before))
        assert drafted > 60 and accepted >= 0.8 * drafted
    # Sampling: a draft is kept where the target samples it (keyed by seed and position).
    sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=30, ignore_eos=True)
               for i in range(len(PROMPTS))]
    assert tokens(llm, sampled) == tokens(LLM(str(target), **ENGINE), sampled)


def assert_targets_tokens(base: LLM, llm: LLM) -> None:
    """Greedy, penalties and seeded sampling: `llm` (with a head) gives `base`'s tokens, and
    its head drafted."""
    params = [greedy(), greedy(repetition_penalty=1.3)] + [
        SamplingParams(temperature=1.0, top_k=8, seed=i, max_tokens=24, ignore_eos=True)
        for i in range(len(PROMPTS))]
    for p in params[:2]:
        assert tokens(llm, p) == tokens(base, p)
    assert tokens(llm, params[2:]) == tokens(base, params[2:])
    assert counters(llm)[0] > 0


def test_a_random_head_gives_the_targets_tokens(random_pair):
    """Greedy, penalties and seeded sampling: the same tokens as without speculation."""
    target, head = random_pair
    assert_targets_tokens(LLM(str(target), **ENGINE), eagle(target, head, k=2))


def test_runs_of_decode_steps_between_drafts(random_pair, drafted_again_after_a_run):
    """A random head's drafts are rejected and it backs off; meanwhile the scheduler runs
    several decode steps a call, after which the head catches up on the run's last position
    (its hidden states from the run) and drafts again: the tokens stay the target's."""
    target, head = random_pair
    base, llm = LLM(str(target), **ENGINE), eagle(target, head, k=2)
    assert tokens(llm, greedy(120), PROMPTS[:1]) == tokens(base, greedy(120), PROMPTS[:1])
    assert drafted_again_after_a_run()


def test_preemption_recomputes_the_heads_kv(mirror_pair, rows_cost_little):
    """Too few blocks for the three requests (the head's bytes counted per block): preempted
    requests come back and the head follows their recomputed prefill."""
    target, head = mirror_pair
    base = LLM(str(target), **ENGINE)
    block_bytes = base.llm_engine.engine_core.executor.worker.kv_block_bytes
    llm = eagle(target, head, kv_cache_memory_bytes=24 * 2 * block_bytes)
    assert tokens(llm, greedy(60)) == tokens(base, greedy(60))
    assert next(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions") > 0
    drafted, accepted = counters(llm)
    assert accepted >= 0.8 * drafted > 0


def test_heads_that_do_not_fit_the_target_are_refused(random_pair, tiny_model_factory,
                                                      tiny_gguf_factory, tmp_path):
    target, head = random_pair
    with pytest.raises(ConfigError, match="which needs it"):
        LLM(str(target), speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    wide = make_eagle_head(tmp_path / "wide", tiny_model_factory("llama", hidden_size=32,
                                                                 num_heads=2, num_kv_heads=1))
    with pytest.raises(ConfigError, match="hidden size 32 for a target of 64"):
        eagle(target, wide)
    with pytest.raises(ConfigError, match="not quantization|Hugging Face directory"):
        eagle(target, tiny_gguf_factory("llama"))
    with pytest.raises(ConfigError, match="num_scheduler_steps"):
        eagle(target, head, num_scheduler_steps=4)
