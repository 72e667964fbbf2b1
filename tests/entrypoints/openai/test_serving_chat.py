"""`POST /v1/chat/completions` through the official openai client against a real server."""

from __future__ import annotations

import math

import pytest

from mrv2 import LLM, SamplingParams

from .conftest import MAX_MODEL_LEN, MODEL_NAME

CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def local(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=MAX_MODEL_LEN, max_num_seqs=32)
    yield llm
    llm.shutdown()


def test_greedy_matches_llm_chat(client, local):
    [expected] = local.chat(CONVERSATION, SamplingParams(temperature=0.0, max_tokens=10,
                                                         ignore_eos=True), use_tqdm=False)
    out = client.chat.completions.create(model=MODEL_NAME, messages=CONVERSATION,
                                         max_tokens=10, temperature=0.0,
                                         extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == "length" and out.object == "chat.completion"
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == 10
    # max_completion_tokens is the newer name for max_tokens; text content parts work too.
    parts = [CONVERSATION[0], {"role": "user", "content": [{"type": "text",
                                                            "text": "Say hi."}]}]
    again = client.chat.completions.create(model=MODEL_NAME, messages=parts,
                                           max_completion_tokens=10, temperature=0.0,
                                           extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == choice.message.content


def test_streaming_roles_and_usage(client):
    full = client.chat.completions.create(model=MODEL_NAME, messages=CONVERSATION,
                                          max_tokens=8, temperature=0.0,
                                          extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=CONVERSATION, max_tokens=8, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == full.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    no_usage = list(client.chat.completions.create(
        model=MODEL_NAME, messages=CONVERSATION, max_tokens=8, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True}))
    assert all(c.usage is None and c.choices for c in no_usage)


def test_n_seed_and_stop(client):
    kwargs = dict(model=MODEL_NAME, messages=CONVERSATION, max_tokens=8, temperature=1.0,
                  n=2, seed=5)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == \
        [c.message.content for c in again.choices]
    streamed = {0: "", 1: ""}
    roles = set()
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.index)
    assert roles == {0, 1}
    assert [streamed[0], streamed[1]] == [c.message.content for c in first.choices]
    base = client.chat.completions.create(model=MODEL_NAME, messages=CONVERSATION,
                                          max_tokens=12, temperature=0.0,
                                          extra_body={"ignore_eos": True})
    text = base.choices[0].message.content
    stop = text[3:5]
    out = client.chat.completions.create(model=MODEL_NAME, messages=CONVERSATION,
                                         max_tokens=12, temperature=0.0, stop=stop,
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == text[:text.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CONVERSATION,
                                                 max_tokens=12, temperature=0.0, stop=stop,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[:text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # Usage counts the prompt once whatever n is (OpenAI and vLLM do).
    assert first.usage.prompt_tokens == base.usage.prompt_tokens


def test_request_chat_template_and_generation_prompt(client, local):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=CONVERSATION, max_tokens=5, temperature=0.0,
        extra_body={"chat_template": template, "ignore_eos": True})
    [expected] = local.chat(CONVERSATION, SamplingParams(temperature=0.0, max_tokens=5,
                                                         ignore_eos=True),
                            chat_template=template, use_tqdm=False)
    assert out.choices[0].message.content == expected.outputs[0].text
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)


# -- logprobs (chat format); need the engine to produce logprobs ----------------------------

def test_logprobs_chat_format(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=CONVERSATION,
                                         max_tokens=5, temperature=0.0, logprobs=True,
                                         top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(e.token for e in content) == out.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3 and math.isfinite(entry.logprob)
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert math.isclose(entry.logprob, values[0], rel_tol=1e-5)
    only_sampled = client.chat.completions.create(model=MODEL_NAME, messages=CONVERSATION,
                                                  max_tokens=3, temperature=0.0, logprobs=True)
    assert all(e.top_logprobs == [] for e in only_sampled.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CONVERSATION,
                                                 max_tokens=5, temperature=0.0, logprobs=True,
                                                 top_logprobs=3, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in content]
