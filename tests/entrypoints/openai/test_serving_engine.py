"""What the endpoints share: the context-length rule, merging streams, error events, and
server-sent events as they go over the wire."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from mrv2.entrypoints.openai.cli_args import ServerConfig
from mrv2.entrypoints.openai.errors import BadRequest, OpenAIError
from mrv2.entrypoints.openai.metrics import ServerMetrics
from mrv2.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, event_stream,
                                                    merge_streams, sse)

from .conftest import MODEL_NAME


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


# -- server-sent events on the wire (a real server, raw HTTP) ------------------------------

def _events(server, path: str, body: dict) -> list:
    """The stream's events, checked for SSE framing: each is one `data: ` line then a blank
    line; the last is `data: [DONE]` and comes once. Returns the other events' JSON."""
    with httpx.stream("POST", f"{server.url}{path}", json=body, headers=server.headers(),
                      timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), raw[:500]
    payloads = [e[len("data: "):] for e in events]
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


COMPLETION = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 6, "temperature": 0.0,
              "ignore_eos": True, "stream": True, "n": 2, "seed": 1}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
        "temperature": 0.0, "ignore_eos": True, "stream": True, "n": 2}


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION),
                                        ("/v1/chat/completions", CHAT)])
def test_sse_framing_and_usage_chunk_only_when_asked(server, path, body):
    plain = _events(server, path, body)
    assert plain and all("usage" not in c and c["choices"] for c in plain)
    with_usage = _events(server, path, {**body, "stream_options": {"include_usage": True}})
    *choices, last = with_usage
    assert all("usage" not in c and c["choices"] for c in choices)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2 * 6
    # Usage counts the prompt once whatever n is (OpenAI and vLLM do).
    single = _events(server, path, {**body, "n": 1, "stream_options": {"include_usage": True}})
    assert last["usage"]["prompt_tokens"] == single[-1]["usage"]["prompt_tokens"]
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 12
    if path == "/v1/chat/completions":
        # Each choice's first chunk carries the role, and no later chunk does.
        seen: set[int] = set()
        for c in plain:
            [choice] = c["choices"]
            assert ("role" in choice["delta"]) == (choice["index"] not in seen)
            seen.add(choice["index"])
        assert seen == {0, 1}


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION),
                                        ("/v1/chat/completions", CHAT)])
def test_continuous_usage_stats(server, path, body):
    options = {"include_usage": True, "continuous_usage_stats": True}
    *choices, last = _events(server, path, {**body, "n": 1, "stream_options": options})
    counts = [c["usage"]["completion_tokens"] for c in choices]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for c in choices)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6


class _Client:
    """An ASGI `receive` whose client disconnects after `after` seconds (or never)."""

    def __init__(self, after: float | None) -> None:
        self.after = after

    async def receive(self) -> dict:
        if self.after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.after)
        return {"type": "http.disconnect"}


def test_a_dropped_non_streaming_request_is_a_499_after_its_cleanup() -> None:
    """The work is cancelled and its cleanup (where the engine abort runs) has finished when
    the 499 is raised; no InvalidStateError from reading a cancelling task."""
    from mrv2.entrypoints.openai.serving_engine import run_until_disconnected

    cleaned = []

    async def work() -> str:
        try:
            await asyncio.sleep(10)
            return "done"
        finally:
            cleaned.append(True)

    async def main() -> None:
        with pytest.raises(OpenAIError) as raised:
            await run_until_disconnected(_Client(after=0.05), work())
        assert raised.value.status == 499 and cleaned == [True]
        assert await run_until_disconnected(_Client(after=None), asyncio.sleep(0, "ok")) == "ok"

    asyncio.run(main())
