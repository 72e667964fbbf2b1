"""Speculative decoding end to end (Speculator through LLM): the same tokens as without it.

Drafts are verified against the token the target samples at each position (noise keyed by
seed and position), so greedy and seeded requests give the same tokens with and without
speculation, in any batch; the tests also check that drafts were made and accepted, so they
cannot pass with speculation silently off.
"""

from __future__ import annotations

import pytest

from mrv2 import LLM, SamplingParams

PROMPTS = [
    {"prompt_token_ids": [(t % 7) + 10 for t in range(30)]},
    {"prompt_token_ids": [(t * t) % 23 + 40 for t in range(90)]},
    {"prompt_token_ids": [3, 9, 27, 81, 3, 9, 27]},
    {"prompt_token_ids": [(t % 11) * 3 + 100 for t in range(150)]},
]
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
              "prompt_lookup_max": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
}
# One decode step a call: every step may draft (by default a batch whose requests hold no
# drafts runs several steps a call, test_draft_model.py's last test). Batch-invariant mode:
# drafts change how a step's tokens are grouped (prefill chunks, rows per step, recomputed
# histories after a preemption), and outside that mode the grouping moves the last bits of a
# logit, so a random model's near-ties fall either way (a CI run on AVX-512 flipped one at
# 1e-6); in it each row's bits are its own, so any difference is the speculation's.
# `test_default_mode_...` covers the default kernels where the grouping is the same.
ENGINE = {"max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64,
          "num_scheduler_steps": 1, "batch_invariant": True}


def greedy(max_tokens: int = 40, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
                             **kwargs})


def tokens(llm: LLM, params, prompts=PROMPTS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def spec_counters(llm: LLM) -> dict[str, int]:
    return {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec")
            and hasattr(m, "value")}


@pytest.fixture(scope="module")
def base(tiny_llama):
    return LLM(str(tiny_llama), **ENGINE)


@pytest.fixture(scope="module", params=sorted(METHODS))
def spec(request, tiny_llama):
    return LLM(str(tiny_llama), speculative_config=METHODS[request.param], **ENGINE)


def test_greedy_identical_and_drafts_accepted(base, spec):
    before = spec_counters(spec)
    assert tokens(spec, greedy()) == tokens(base, greedy())
    after = spec_counters(spec)
    assert after["vllm:spec_decode_num_drafts"] > before.get("vllm:spec_decode_num_drafts", 0)
    assert (after["vllm:spec_decode_num_accepted_tokens"]
            > before.get("vllm:spec_decode_num_accepted_tokens", 0))
    per_pos = next(m for m in spec.get_metrics()
                   if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos")
    assert len(per_pos.values) == 4 and per_pos.values[0] >= per_pos.values[-1]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_default_mode_greedy_identical_when_each_prompt_prefills_in_one_step(tiny_llama, method):
    """The default kernels, one request at a time, its prompt in one step: every later step
    is its decode or verify rows on the fused stack (at most `verify_rows`), each row summed
    as a lone decode row is, so the tokens are the same bits with and without drafts."""
    engine = {**ENGINE, "batch_invariant": False, "max_num_batched_tokens": 256}
    base = LLM(str(tiny_llama), **engine)
    spec = LLM(str(tiny_llama), speculative_config=METHODS[method], **engine)
    for prompt in PROMPTS:
        assert tokens(spec, greedy(), [prompt]) == tokens(base, greedy(), [prompt])
    assert spec_counters(spec)["vllm:spec_decode_num_accepted_tokens"] > 0


def test_seeded_sampling_identical(base, spec):
    params = [SamplingParams(temperature=1.0, top_k=8, seed=i, max_tokens=32, ignore_eos=True)
              for i in range(len(PROMPTS))]
    assert tokens(spec, params) == tokens(base, params)


def test_requests_that_do_not_draft_ride_along(base, spec):
    """Prompt logprobs keep a request on one token a step, in the same batches; a request with
    logprobs drafts, and gets each kept token's logprobs (its verify row's)."""
    params = [greedy(), greedy(prompt_logprobs=1), greedy(logprobs=2), greedy()]
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    want = base.generate(PROMPTS, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == [
        list(o.outputs[0].token_ids) for o in want]
    lp_got, lp_want = got[2].outputs[0].logprobs, want[2].outputs[0].logprobs
    assert len(lp_got) == len(got[2].outputs[0].token_ids)
    assert [sorted(d) for d in lp_got] == [sorted(d) for d in lp_want]
    assert [d[t].logprob for d in lp_got for t in sorted(d)] == pytest.approx(
        [d[t].logprob for d in lp_want for t in sorted(d)], abs=1e-5)


def test_grammar_rows_beside_verify_rows(base, spec):
    """A structured-output request gets its bitmasks on its own rows while the requests
    before it in the batch verify drafts; alone, its own drafts (those its grammar accepts)
    are verified under a mask per row and accepted."""
    from mrv2.sampling_params import StructuredOutputsParams

    constrained = greedy(16, structured_outputs=StructuredOutputsParams(regex="[0-9a-f]{12}"))
    params = [greedy(), greedy(), constrained, greedy()]
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    want = base.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert len(got[2].outputs[0].text) == 12
    repeating = greedy(40, structured_outputs=StructuredOutputsParams(regex="(abc ){12}"))
    before = spec_counters(spec).get("vllm:spec_decode_num_accepted_tokens", 0)
    got = spec.generate(PROMPTS[:1], repeating, use_tqdm=False)[0].outputs[0]
    assert got.text == base.generate(PROMPTS[:1], repeating, use_tqdm=False)[0].outputs[0].text
    assert got.text == "abc " * 12
    assert spec_counters(spec)["vllm:spec_decode_num_accepted_tokens"] > before


def test_stop_token_inside_an_accepted_run(base, spec):
    reference = tokens(base, greedy())
    stop = reference[0][12]
    first = reference[0].index(stop)
    out = spec.generate(PROMPTS[:1], greedy(stop_token_ids=[stop], ignore_eos=False),
                        use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == reference[0][:first + 1]
    assert out.finish_reason == "stop"


def test_max_tokens_exact(spec, base):
    for n in (1, 2, 5, 7):
        assert tokens(spec, greedy(n)) == tokens(base, greedy(n))


def test_preemption_and_async_scheduling_give_the_same_tokens(base, tiny_llama):
    """A pool of 24 blocks for four requests of up to 12 each: preempted requests recompute
    their history and draft again; with async scheduling on, a request's next step waits for
    the step in flight (its drafts)."""
    block_bytes = base.llm_engine.engine_core.executor.worker.kv_block_bytes
    llm = LLM(str(tiny_llama), speculative_config=METHODS["ngram"], async_scheduling=True,
              **{**ENGINE, "kv_cache_memory_bytes": 24 * block_bytes})
    assert tokens(llm, greedy()) == tokens(base, greedy())
    assert next(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions") > 0


def test_a_16_bit_model_drafts(tiny_llama):
    """Where the fused stack takes one row (a bfloat16 model on a CPU whose few-row kernels
    read the packed weights), verify steps run on the layers between oneDNN calls: requests
    draft and have drafts kept. (Their tokens are the target's as a batch of that many rows
    rounds: a random model's near-ties can fall the other way than at one row.)"""
    engine = {"max_model_len": 256, "num_scheduler_steps": 1, "dtype": "bfloat16"}
    llm = LLM(str(tiny_llama), speculative_config=METHODS["ngram"], **engine)
    tokens(llm, greedy(), PROMPTS[:2])
    assert spec_counters(llm)["vllm:spec_decode_num_accepted_tokens"] > 0


def test_refused_combinations(tiny_llama):
    from mrv2.config import ConfigError

    with pytest.raises(ConfigError, match="num_scheduler_steps"):
        LLM(str(tiny_llama), speculative_config=METHODS["ngram"], num_scheduler_steps=4)
    with pytest.raises(ConfigError, match="not implemented"):
        LLM(str(tiny_llama), speculative_config={"method": "mtp", "model": "x",
                                                 "num_speculative_tokens": 2})
