"""Draft-model speculation (spec_decode/draft_model.py) end to end: the same tokens as without
it, and, where the draft is the target itself, every draft accepted (any draft KV the draft
model got wrong, or lost to a missing lookahead block, would show as a rejection)."""

from __future__ import annotations

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.config import ConfigError

ENGINE = {"max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 64}
# Prompts longer than the step's 64 tokens: the draft follows their chunks.
PROMPTS = [
    {"prompt_token_ids": [(t * t) % 23 + 40 for t in range(90)]},
    {"prompt_token_ids": [(t % 11) * 3 + 100 for t in range(150)]},
    {"prompt_token_ids": [3, 9, 27, 81, 3, 9, 27]},
]


def greedy(max_tokens: int = 40, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
                             **kwargs})


def tokens(llm: LLM, params, prompts=PROMPTS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def counters(llm: LLM) -> tuple[int, int]:
    values = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec")
              and hasattr(m, "value")}
    return (values.get("vllm:spec_decode_num_draft_tokens", 0),
            values.get("vllm:spec_decode_num_accepted_tokens", 0))


def drafting(target, draft, k: int = 4, **kwargs) -> LLM:
    return LLM(str(target), speculative_config={"model": str(draft), "num_speculative_tokens": k},
               **{**ENGINE, **kwargs})


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    return tiny_model_factory("llama", init_scale=4.0)  # peaked logits: few near-ties


@pytest.fixture(scope="module")
def small_draft(tiny_model_factory):
    return tiny_model_factory("llama", seed=1, hidden_size=32, num_layers=1, num_heads=2,
                              num_kv_heads=1, init_scale=4.0)


@pytest.fixture(scope="module")
def base(target):
    return LLM(str(target), **ENGINE)


@pytest.fixture(scope="module")
def self_draft(target):
    return drafting(target, target)


def test_the_target_as_its_own_draft_has_every_draft_accepted(base, self_draft,
                                                              rows_cost_little):
    """One request at a time (the most drafts: a step's verify rows stay within the fused
    stack's rows), then the three together; prompts in chunks, drafts across block
    boundaries (lookahead blocks); the second round hits the prefix cache, which the draft
    catches up on."""
    want = tokens(base, greedy())
    for _ in range(2):
        before = counters(self_draft)
        assert [tokens(self_draft, greedy(), [p])[0] for p in PROMPTS] == want
        assert tokens(self_draft, greedy()) == want
        drafted, accepted = (a - b for a, b in zip(counters(self_draft), before))
        assert drafted > 60 and accepted == drafted


def test_penalties_count_the_drafts_before_each_verify_row(base, self_draft):
    """Requests with penalties draft too (the draft proposes without them, so the penalties
    reject some drafts): each verify row's penalties count the drafts before it and the kept
    tokens are counted, so the tokens are those without drafts."""
    params = [greedy(60, repetition_penalty=1.5), greedy(60, frequency_penalty=1.0),
              greedy(60, presence_penalty=1.0),
              SamplingParams(temperature=1.0, seed=3, max_tokens=60, ignore_eos=True,
                             frequency_penalty=0.5, repetition_penalty=1.2)]
    plain = tokens(base, greedy(60), PROMPTS[:1])[0]
    for p in params:
        before = counters(self_draft)[1]
        want = tokens(base, p, PROMPTS[:1])
        assert want[0] != plain  # the penalty changes the answer
        assert tokens(self_draft, p, PROMPTS[:1]) == want
        assert counters(self_draft)[1] > before  # drafts accepted


def test_a_smaller_draft_gives_the_targets_tokens(base, target, small_draft):
    llm = drafting(target, small_draft, k=3)
    assert tokens(llm, greedy()) == tokens(base, greedy())
    params = [SamplingParams(temperature=1.0, top_k=8, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(len(PROMPTS))]
    assert tokens(llm, params) == tokens(base, params)
    assert counters(llm)[0] > 0


def test_preemption_recomputes_the_drafts_kv(base, target):
    """24 blocks for three requests of up to 12 each (the draft's bytes counted per block):
    preempted requests come back and the draft follows their recomputed history."""
    block_bytes = base.llm_engine.engine_core.executor.worker.kv_block_bytes
    llm = drafting(target, target, kv_cache_memory_bytes=24 * 2 * block_bytes)
    assert llm.llm_engine.engine_core.executor.worker.kv_block_bytes == 2 * block_bytes
    before = counters(llm)
    assert tokens(llm, greedy(60)) == tokens(base, greedy(60))
    assert next(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions") > 0
    drafted, accepted = (a - b for a, b in zip(counters(llm), before))
    assert accepted == drafted > 0


def test_a_draft_of_another_vocabulary_is_refused(target, tiny_model_factory):
    other = tiny_model_factory("llama", vocab_size=4096)
    with pytest.raises(ConfigError, match="vocabulary of 4096"):
        drafting(target, other)


def test_runs_of_decode_steps_while_no_request_drafts(base, target, small_draft,
                                                      drafted_again_after_a_run):
    """A draft that keeps missing backs off; while no running request holds drafts the
    scheduler runs several decode steps a call (core/decode_steps.py), and drafting resumes
    after the backoff, proposed at the end of such a run."""
    llm = drafting(target, small_draft, k=3)
    assert tokens(llm, greedy(120), PROMPTS[:1]) == tokens(base, greedy(120), PROMPTS[:1])
    assert drafted_again_after_a_run()


def test_sleep_and_wake_up_keep_drafting(base, target):
    """Sleep drops the draft's KV cache with the target's (level 2 the target's weights too);
    after wake_up the draft follows and drafts again from zeroed caches."""
    llm = drafting(target, target, k=3)
    want = tokens(base, greedy(60), PROMPTS[:1])
    for level in (1, 2):
        llm.sleep(level)
        llm.wake_up()
        before = counters(llm)
        assert tokens(llm, greedy(60), PROMPTS[:1]) == want
        drafted, accepted = (a - b for a, b in zip(counters(llm), before))
        assert accepted == drafted > 0
