"""What the endpoints share: the context-length rule, merging streams, error events."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from mrv2.entrypoints.openai.cli_args import ServerConfig
from mrv2.entrypoints.openai.errors import BadRequest, OpenAIError
from mrv2.entrypoints.openai.metrics import ServerMetrics
from mrv2.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, event_stream,
                                                    merge_streams, sse)


def serving(max_model_len: int = 100, defaults: dict | None = None) -> OpenAIServing:
    engine = SimpleNamespace(config=SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len)))
    return OpenAIServing(engine, ServerConfig(model="/m", served_model_names=["m", "n"]),
                         ServerMetrics("m"), defaults or {})


def test_max_tokens_and_the_context_length():
    s = serving()
    assert s.max_tokens_for(10, None) == 90
    assert s.max_tokens_for(10, 90) == 90
    with pytest.raises(BadRequest, match="maximum context length is 100 tokens. However, you "
                                         r"requested 101 tokens \(10 in the input, 91"):
        s.max_tokens_for(10, 91)
    with pytest.raises(BadRequest, match="has 100 input tokens"):
        s.max_tokens_for(100, None)
    capped = serving(defaults={"max_tokens": 8})
    assert capped.max_tokens_for(10, None) == 8 and capped.max_tokens_for(10, 50) == 8
    assert capped.max_tokens_for(95, None) == 5


def test_model_names():
    s = serving()
    s.check_model(None)
    s.check_model("n")
    with pytest.raises(OpenAIError) as info:
        s.check_model("x")
    assert info.value.status == 404 and info.value.code == "model_not_found"


async def _items(*values, fail: Exception | None = None, delay: float = 0.0):
    for value in values:
        await asyncio.sleep(delay)
        yield value
    if fail is not None:
        raise fail


def test_merge_streams_interleaves_and_propagates_errors():
    async def collect(streams):
        return [item async for item in merge_streams(streams)]

    merged = asyncio.run(collect([_items("a", "b", delay=0.01), _items(1, 2, 3)]))
    assert sorted(i for i, _ in merged) == [0, 0, 1, 1, 1]
    assert [v for i, v in merged if i == 0] == ["a", "b"]
    with pytest.raises(ValueError, match="boom"):
        asyncio.run(collect([_items(1, fail=ValueError("boom")), _items(2, delay=1.0)]))


def test_event_stream_ends_with_done_even_after_an_error():
    async def collect(chunks):
        return [c async for c in event_stream(chunks)]

    assert asyncio.run(collect(_items(sse({"a": 1})))) == ['data: {"a":1}\n\n', SSE_DONE]
    out = asyncio.run(collect(_items(sse({"a": 1}), fail=ValueError("bad value"))))
    assert out[-1] == SSE_DONE and '"bad value"' in out[1] and '"error"' in out[1]
