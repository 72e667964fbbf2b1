"""End to end: LLM.generate against transformers' greedy generate, and bad input."""

from __future__ import annotations

import random

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.config import ConfigError
from mrv2.engine.input_processor import PromptError

PROMPT_LENS = [1, 2, 3, 5, 8, 15, 16, 17, 31, 64, 100, 127, 128, 129, 200, 300]
MAX_TOKENS = 64


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # ignore_eos: generation must not stop at EOS, and EOS must stay sampleable.
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=0)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module")
def greedy_case(tiny_llama):
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in PROMPT_LENS]
    return prompts, hf_greedy(tiny_llama, prompts, MAX_TOKENS)


def _generate(model_dir, prompts, **llm_kwargs):
    llm = LLM(str(model_dir), max_model_len=512, block_size=16, **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outputs


def test_greedy_matches_transformers_with_chunked_prefill(tiny_llama, greedy_case):
    prompts, expected = greedy_case
    llm, outputs = _generate(tiny_llama, prompts, max_num_batched_tokens=128)
    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, output, want in zip(prompts, outputs, expected):
        completion = output.outputs[0]
        assert output.finished and completion.finish_reason == "length"
        assert completion.token_ids == want, f"prompt of {len(prompt)} tokens diverged"


def test_greedy_matches_transformers_under_preemption(tiny_llama, greedy_case):
    prompts, expected = greedy_case
    # 60 blocks of 16 tokens cannot hold all 16 requests (they need ~200): the scheduler must
    # preempt and resume requests, and the outputs must not change.
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    llm, outputs = _generate(tiny_llama, prompts, max_num_batched_tokens=128,
                             kv_cache_memory_gb=60 * block_bytes / (1 << 30))
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_max_num_seqs_limits_the_batch(tiny_llama, greedy_case):
    prompts, expected = greedy_case
    _, outputs = _generate(tiny_llama, prompts[:6], max_num_seqs=2, max_num_batched_tokens=64)
    assert [o.outputs[0].token_ids for o in outputs] == expected[:6]


def test_text_prompts_stop_at_eos_and_stop_token_ids(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=256)
    tokenizer = llm.get_tokenizer()
    base = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=20,
                                                      ignore_eos=True), use_tqdm=False)[0]
    tokens = base.outputs[0].token_ids
    assert base.prompt == "hello world"
    assert base.prompt_token_ids == tokenizer("hello world").input_ids
    assert base.outputs[0].text == tokenizer.decode(tokens, skip_special_tokens=True)
    # Stopping at the 5th generated token's id, unless it already appeared earlier.
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=20,
                                                     stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens suppresses the stop until enough tokens were generated.
    out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=20,
                                                     min_tokens=first + 2,
                                                     stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > first + 1


def test_seeded_sampling_is_reproducible_and_batch_invariant(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=256)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate("a seeded prompt", params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=16) for _ in range(5)]
    batch = llm.generate(["x y z", "other", "a seeded prompt", "more text", "zz", "q"],
                         others[:2] + [params] + others[2:], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    a, b = llm.generate(["same", "same"], unseeded, use_tqdm=False)
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_seeded_request_alone_among_16_others_and_at_another_position(tiny_llama):
    """Issue 4: a seeded request (temperature 0.8, seed 1234) draws the same tokens, with the
    same logprobs, alone, first in a batch of 16 others and last in it."""
    llm = LLM(str(tiny_llama), max_model_len=256, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.8, seed=1234, max_tokens=24, ignore_eos=True,
                            logprobs=2)
    prompt = "the seeded request's prompt"
    rng = random.Random(0)
    others = [{"prompt_token_ids": [rng.randrange(3, 2000) for _ in range(rng.randrange(1, 90))]}
              for _ in range(16)]
    other_params = [SamplingParams(temperature=t, max_tokens=rng.randrange(4, 30),
                                   top_p=rng.choice([1.0, 0.9]), seed=rng.choice([None, i]))
                    for i, t in enumerate([0.0, 0.8, 1.0, 1.3] * 4)]
    [alone] = llm.generate(prompt, params, use_tqdm=False)
    first = llm.generate([prompt, *others], [params, *other_params], use_tqdm=False)[0]
    last = llm.generate([*others, prompt], [*other_params, params], use_tqdm=False)[-1]
    want = alone.outputs[0]
    assert len(set(want.token_ids)) > 4  # really sampled
    for got in (first.outputs[0], last.outputs[0]):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert list(a) == list(b)
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    llm.shutdown()


@pytest.mark.parametrize("kwargs, error, words", [
    ({"block_size": 12}, ConfigError, ["block_size=12", "power of two"]),
    ({"max_model_len": 10**6}, ConfigError, ["max_model_len=1000000"]),
    ({"dtype": "int7"}, ValueError, ["int7"]),
])
def test_bad_engine_args(tiny_llama, kwargs, error, words):
    with pytest.raises(error) as info:
        LLM(str(tiny_llama), **kwargs)
    assert all(w in str(info.value) for w in words)


def test_missing_model_and_dir_without_config(tmp_path):
    with pytest.raises(ValueError, match="does not exist|not found|No such"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture(tiny_model_factory, tmp_path):
    import json
    import shutil

    src = tiny_model_factory("llama")
    dst = tmp_path / "gpt2ish"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        LLM(str(dst))
    assert "GPT2LMHeadModel" in str(info.value) and "LlamaForCausalLM" in str(info.value)


def _set_after_construction(**fields) -> SamplingParams:
    """Params whose fields were changed after SamplingParams validated them."""
    params = SamplingParams(max_tokens=4)
    for name, value in fields.items():
        setattr(params, name, value)
    return params


@pytest.fixture(scope="module")
def small_llm(tiny_llama):
    return LLM(str(tiny_llama), max_model_len=64)


@pytest.mark.parametrize("prompt, params, error, words", [
    ("", None, PromptError, ["empty"]),
    ({"prompt_token_ids": []}, None, PromptError, ["empty"]),
    ({"prompt_token_ids": list(range(3, 67))}, None, PromptError, ["64", "max_model_len"]),
    ({"prompt_token_ids": list(range(3, 103))}, None, PromptError, ["100", "64"]),
    ({"prompt_token_ids": [1, 10**7]}, None, PromptError, ["10000000", "vocabulary"]),
    (123, None, PromptError, ["int"]),
    ("hi", _set_after_construction(logprobs=21), ValueError, ["logprobs=21", "[0, 20]"]),
    ("hi", SamplingParams(logit_bias={10**7: 1.0}), ValueError, ["logit_bias", "vocabulary"]),
])
def test_bad_prompts_are_rejected_before_any_work(small_llm, prompt, params, error, words):
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(error) as info:
        small_llm.generate([good, prompt], params or SamplingParams(max_tokens=4),
                           use_tqdm=False)
    assert all(w in str(info.value) for w in words), str(info.value)
    # Nothing was added, and the engine still serves.
    assert not small_llm.llm_engine.has_unfinished_requests()
    out = small_llm.generate(good, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.5}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_list_must_match_prompts(small_llm):
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        small_llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_identical_with_async_scheduling_on_and_off(tiny_llama, greedy_case,
                                                          async_scheduling):
    prompts, expected = greedy_case
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    llm, outputs = _generate(tiny_llama, prompts, max_num_batched_tokens=128,
                             kv_cache_memory_gb=60 * block_bytes / (1 << 30),
                             async_scheduling=async_scheduling)
    assert llm.llm_engine.config.scheduler_config.async_scheduling is async_scheduling
    assert [o.outputs[0].token_ids for o in outputs] == expected
    core = llm.llm_engine.engine_core
    assert core.executor.worker.runner.requests.num_active == 0
    assert core.scheduler.kv_cache_usage == 0
