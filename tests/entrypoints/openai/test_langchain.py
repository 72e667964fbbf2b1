"""langchain-openai's `ChatOpenAI` against `mrv2 serve`, as an agent framework user points it
at a vLLM server: sync and async calls, streaming, n > 1, logprobs, stop strings, seeds.

The model has random weights: the tests check the protocol (every field langchain reads is
there and consistent), and determinism where the request is greedy or seeded."""

from __future__ import annotations

import asyncio

import pytest

from tests.entrypoints.openai.conftest import API_KEY, MODEL_NAME

langchain_openai = pytest.importorskip("langchain_openai")
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage  # noqa: E402

MESSAGES = [HumanMessage("Say something.")]


def _chat(server, **kwargs):
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 12)
    return langchain_openai.ChatOpenAI(model=MODEL_NAME, base_url=f"{server.url}/v1",
                                       api_key=API_KEY, max_retries=0, timeout=60, **kwargs)


def test_invoke_and_stream_give_the_same_greedy_text(server):
    chat = _chat(server)
    message = chat.invoke(MESSAGES)
    assert isinstance(message, AIMessage) and message.content
    assert message.response_metadata["model_name"] == MODEL_NAME
    assert message.response_metadata["finish_reason"] == "length"
    usage = message.usage_metadata
    assert usage["output_tokens"] == 12
    assert usage["total_tokens"] == usage["input_tokens"] + 12
    chunks = list(_chat(server, stream_usage=True).stream(MESSAGES))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert merged.content == message.content
    assert merged.usage_metadata["output_tokens"] == 12
    assert merged.response_metadata["finish_reason"] == "length"


def test_n_choices_logprobs_stop_and_seed(server):
    result = _chat(server, n=3, temperature=1.0, seed=7).generate([MESSAGES])
    texts = [g.text for g in result.generations[0]]
    assert len(texts) == 3
    again = _chat(server, n=3, temperature=1.0, seed=7).generate([MESSAGES])
    assert [g.text for g in again.generations[0]] == texts  # seeded: reproducible

    with_logprobs = _chat(server, logprobs=True, top_logprobs=2).invoke(MESSAGES)
    content = with_logprobs.response_metadata["logprobs"]["content"]
    assert len(content) == 12
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
    assert "".join(entry["token"] for entry in content) == with_logprobs.content

    # Stop at a string the greedy text is known to contain: the text ends before it.
    full = _chat(server).invoke(MESSAGES).content
    stop = full[len(full) // 2:len(full) // 2 + 2]
    stopped = _chat(server, stop=[stop]).invoke(MESSAGES)
    assert stopped.response_metadata["finish_reason"] == "stop"
    assert stopped.content == full[:full.index(stop)]


def test_async_batch(server):
    chat = _chat(server)

    async def run():
        return await chat.abatch([MESSAGES, [HumanMessage("Another one.")]])

    first, second = asyncio.run(run())
    assert first.content == chat.invoke(MESSAGES).content and second.content
