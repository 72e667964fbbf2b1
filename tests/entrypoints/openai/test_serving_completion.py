"""`POST /v1/completions` through the official openai client against a real server."""

from __future__ import annotations

import math

import openai
import pytest

from mrv2 import LLM, SamplingParams

from .conftest import MAX_MODEL_LEN, MODEL_NAME

PROMPTS = ["hello world", "def fibonacci(n):", "the quick brown fox"]


@pytest.fixture(scope="module")
def local(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=MAX_MODEL_LEN, max_num_seqs=32)
    yield llm
    llm.shutdown()


def test_greedy_matches_llm_generate(client, local):
    expected = local.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12,
                                                      ignore_eos=True), use_tqdm=False)
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=12,
                                         temperature=0.0, extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [e.outputs[0].text for e in expected]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.model == MODEL_NAME and response.object == "text_completion"
    num_prompt = sum(len(e.prompt_token_ids) for e in expected)
    assert response.usage.prompt_tokens == num_prompt
    assert response.usage.completion_tokens == 36
    assert response.usage.total_tokens == num_prompt + 36
    # Token-id prompts (a list, and a list of lists) give the same completions.
    ids = [e.prompt_token_ids for e in expected]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=12,
                                       temperature=0.0, extra_body={"ignore_eos": True})
    assert [c.text for c in by_ids.choices] == [c.text for c in response.choices]
    one = client.completions.create(model=MODEL_NAME, prompt=ids[0], max_tokens=12,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    assert one.choices[0].text == response.choices[0].text


def test_streaming_with_and_without_usage(client):
    full = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=10,
                                     temperature=0.0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="hello world",
                                            max_tokens=10, temperature=0.0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)
    with_usage = list(client.completions.create(
        model=MODEL_NAME, prompt="hello world", max_tokens=10, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    last = with_usage[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert "".join(c.choices[0].text for c in with_usage[:-1]) == full.choices[0].text


def test_n_samples_and_seed(client):
    kwargs = dict(model=MODEL_NAME, prompt="once upon a time", max_tokens=8, temperature=1.0,
                  n=2, seed=1234)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    other = client.completions.create(**{**kwargs, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in first.choices]
    # Two prompts x n=2: index = prompt * n + sample.
    both = client.completions.create(**{**kwargs, "prompt": ["a b c", "once upon a time"]})
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices[2:]] == [c.text for c in first.choices]
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[0], streamed[1]] == [c.text for c in first.choices]


def test_stop_strings(client):
    base = client.completions.create(model=MODEL_NAME, prompt="the quick brown fox",
                                     max_tokens=16, temperature=0.0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[4:6]
    assert stop and stop in base
    cut = base[:base.index(stop)]
    out = client.completions.create(model=MODEL_NAME, prompt="the quick brown fox",
                                    max_tokens=16, temperature=0.0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert out.text == cut and out.finish_reason == "stop"
    kept = client.completions.create(
        model=MODEL_NAME, prompt="the quick brown fox", max_tokens=16, temperature=0.0,
        stop=stop, extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == cut + stop
    # Streaming never sends text past the stop string.
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="the quick brown fox",
                                            max_tokens=16, temperature=0.0, stop=[stop],
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_streaming_holds_back_stop_strings_that_span_tokens(client):
    """A stop string that starts at the end of one token and ends in the next: its first part
    must be held back while streaming, never sent and then found to be after the cut."""
    prompt = "the quick brown fox"
    base = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16,
                                     temperature=0.0, logprobs=0,
                                     extra_body={"ignore_eos": True}).choices[0]
    tokens, text = base.logprobs.tokens, base.text
    assert "".join(tokens) == text
    ends = [sum(len(t) for t in tokens[:j + 1]) for j in range(len(tokens) - 1)
            if tokens[j] and tokens[j + 1]]
    assert len(ends) >= 3, tokens
    for end in ends[:4]:
        stop = text[end - 1:end + 1]
        cut = text[:text.index(stop)]
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16,
                                                temperature=0.0, stop=[stop], stream=True,
                                                extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks) == cut, (stop, tokens)
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_usage_counts_each_prompt_once(client):
    kwargs = dict(model=MODEL_NAME, max_tokens=3, temperature=1.0, seed=3,
                  extra_body={"ignore_eos": True})
    two = client.completions.create(prompt=[5, 6, 7, 8], n=2, **kwargs).usage
    assert (two.prompt_tokens, two.completion_tokens, two.total_tokens) == (4, 6, 10)
    both = client.completions.create(prompt=[[5, 6, 7, 8], [9, 10]], n=2, **kwargs).usage
    assert (both.prompt_tokens, both.completion_tokens, both.total_tokens) == (6, 12, 18)
    streamed = list(client.completions.create(prompt=[[5, 6, 7, 8], [9, 10]], n=2, stream=True,
                                              stream_options={"include_usage": True},
                                              **kwargs))[-1].usage
    assert (streamed.prompt_tokens, streamed.completion_tokens) == (6, 12)


def test_extra_body_parameters(client, local):
    prompt = "import os"
    extra = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3, "ignore_eos": True,
             "min_tokens": 4, "skip_special_tokens": False}
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6,
                                    temperature=0.8, seed=7, top_p=0.9, presence_penalty=0.5,
                                    frequency_penalty=0.2, extra_body=extra)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=7, top_p=0.9,
                            presence_penalty=0.5, frequency_penalty=0.2, **extra)
    [expected] = local.generate(prompt, params, use_tqdm=False)
    assert out.choices[0].text == expected.outputs[0].text
    assert out.usage.completion_tokens == 6
    # stop_token_ids and a logit bias that forces one token.
    forced = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3,
                                       temperature=0.0, logit_bias={"300": 100})
    tokenizer = local.get_tokenizer()
    assert forced.choices[0].text == tokenizer.decode([300] * 3)
    stopped = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5,
                                        temperature=0.0, logit_bias={"300": 100},
                                        extra_body={"stop_token_ids": [300]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra.get("stop_reason") == 300
    assert stopped.usage.completion_tokens == 1
    # min_tokens keeps the stop token out of the first 3 tokens: it stops at the 4th.
    held = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8,
                                     temperature=0.0, logit_bias={"300": 100},
                                     extra_body={"stop_token_ids": [300], "min_tokens": 3})
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 4


def test_echo(client, local):
    out = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=4,
                                    temperature=0.0, echo=True)
    plain = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=4,
                                      temperature=0.0)
    assert out.choices[0].text == "hello world" + plain.choices[0].text


def test_default_max_tokens_is_16(client):
    out = client.completions.create(model=MODEL_NAME, prompt="hello", temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16


# -- logprobs (legacy format); need the engine to produce logprobs ---------------------------

def test_logprobs_legacy_format(client):
    out = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=5,
                                    temperature=0.0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0 and math.isfinite(logprob)
        assert 3 <= len(top) <= 4 and token in top
        # Greedy: the sampled token is the most likely one.
        assert math.isclose(top[token], max(top.values()), rel_tol=1e-5)
    streamed = list(client.completions.create(model=MODEL_NAME, prompt="hello world",
                                              max_tokens=5, temperature=0.0, logprobs=3,
                                              stream=True, extra_body={"ignore_eos": True}))
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in streamed if c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_logprobs_with_echo_include_the_prompt(client):
    out = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=3,
                                    temperature=0.0, logprobs=1, echo=True)
    lp = out.choices[0].logprobs
    num_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens).endswith(out.choices[0].text[len("hello world"):])


def test_echo_with_max_tokens_0_scores_the_prompt_only(client):
    """lm-eval's loglikelihood request: echo, max_tokens=0, logprobs; nothing generated."""
    scored = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=0,
                                       temperature=0.0, logprobs=2, echo=True)
    generated = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=1,
                                          temperature=0.0, logprobs=2, echo=True)
    choice, num_prompt = scored.choices[0], scored.usage.prompt_tokens
    assert choice.text == "hello world" and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == num_prompt
    assert lp.token_logprobs[0] is None and all(v < 0 for v in lp.token_logprobs[1:])
    # The prompt part equals what an echo with one generated token reports for it.
    assert lp.token_logprobs == generated.choices[0].logprobs.token_logprobs[:num_prompt]
    # Streaming: the prompt, then the end, no generated text.
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="hello world",
                                            max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "hello world"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_max_tokens_0_without_echo_is_400(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=0)
