"""openai/chat_output.py: the whole message and the streamed deltas of one choice agree, for
every tool_choice and with a reasoning parser, however the text is cut into chunks."""

from __future__ import annotations

import json
import random

import pytest

from mrv2.entrypoints.openai.chat_output import ChatChoiceParser
from mrv2.entrypoints.openai.protocol import ChatCompletionRequest
from mrv2.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from mrv2.entrypoints.openai.tool_parsers import get_tool_parser

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "time"}}]
NAMED = {"type": "function", "function": {"name": "weather"}}


def parser(tool_choice=None, tools=TOOLS, reasoning: str | None = None,
           tool_parser: str | None = None) -> ChatChoiceParser:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    if tools:
        body["tools"] = tools
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    request = ChatCompletionRequest.model_validate(body)
    return ChatChoiceParser(
        request, get_reasoning_parser(reasoning)() if reasoning else None,
        get_tool_parser(tool_parser)() if tool_parser else None)


def streamed(make, text: str, sizes) -> tuple[dict, bool]:
    """The deltas of `text` cut at `sizes`, folded into one message."""
    p = make()
    message = {"content": "", "reasoning": "", "tool_calls": {}}
    pieces, i = [], 0
    for size in sizes:
        pieces.append(text[i:i + size])
        i += size
    pieces.append(text[i:])
    deltas = [p.delta(piece) for piece in pieces] + [p.finish()]
    for delta in filter(None, deltas):
        message["content"] += delta.get("content", "")
        message["reasoning"] += delta.get("reasoning", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["type"] == "function" and "name" in call["function"]
                message["tool_calls"][call["index"]] = {"name": call["function"]["name"],
                                                        "arguments": ""}
            else:
                assert set(call) == {"index", "function"}
            message["tool_calls"][call["index"]]["arguments"] += call["function"]["arguments"]
    calls = [message["tool_calls"][i] for i in sorted(message["tool_calls"])]
    return {"content": message["content"] or None, "reasoning": message["reasoning"] or None,
            "tool_calls": calls}, bool(calls)


def whole(make, text: str) -> tuple[dict, bool]:
    message, called = make().message(text)
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in message["tool_calls"]]
    return {"content": message["content"] or None, "reasoning": message["reasoning"] or None,
            "tool_calls": calls}, called


CASES = [
    ("free text", lambda: parser(tools=None), "Hello there", False),
    ("reasoning", lambda: parser(tools=None, reasoning="deepseek_r1"),
     "let me think</think>The answer is 4.", False),
    ("named", lambda: parser(NAMED), '{"city": "Oslo"}', True),
    ("required", lambda: parser("required"),
     '[{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "time", '
     '"parameters": {}}]', True),
    ("auto hermes", lambda: parser("auto", tool_parser="hermes"),
     'Sure.<tool_call>\n{"name": "weather", "arguments": {"city": "Bergen"}}\n</tool_call>',
     True),
    ("auto without a call", lambda: parser("auto", tool_parser="hermes"), "No tools.", False),
    ("reasoning then required", lambda: parser("required", reasoning="qwen3"),
     '<think>hmm</think>[{"name": "time", "parameters": {}}]', True),
]


@pytest.mark.parametrize("name, make, text, calls", CASES, ids=[c[0] for c in CASES])
def test_stream_equals_whole(name, make, text, calls):
    expected, called = whole(make, text)
    assert called == calls
    rng = random.Random(0)
    chunkings = [[1] * len(text), [], *[[rng.randint(1, 6) for _ in range(len(text))]
                                        for _ in range(5)]]
    for sizes in chunkings:
        assert streamed(make, text, sizes) == (expected, calls)


def test_whole_messages():
    message, called = parser("required").message(
        '[{"name": "weather", "parameters": {"city": "Oslo"}}]')
    assert called and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert message["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    cut, called = parser("required").message('[{"name": "weather", "para')  # length
    assert not called and cut["content"] == '[{"name": "weather", "para'
    named, called = parser(NAMED).message('{"city": "X"}')
    assert called and named["tool_calls"][0]["function"] == {"name": "weather",
                                                             "arguments": '{"city": "X"}'}
