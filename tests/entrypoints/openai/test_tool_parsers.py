"""Tool parsers: whole-output results (as vLLM's hermes / llama3_json parsers give them), and
streaming that reassembles to exactly those results however the output is cut into chunks."""

from __future__ import annotations

import json

import pytest

from mrv2.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from mrv2.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, StreamDelta, ToolCall
from mrv2.entrypoints.openai.tool_parsers.json_stream import JsonCanonicalizer

from .stream_helpers import chunkings as stream_chunkings


def chunkings(text: str, seeds: int = 8):
    """Whole, one character at a time, random sizes up to 9 (fixed seeds), every third cut in
    two."""
    return stream_chunkings(text, seeds, max_piece=9, cut_step=3)


def stream(parser_cls, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) per call, reassembled from the deltas, checking each
    delta's shape on the way."""
    parser = parser_cls(None)
    content: list[str] = []
    calls: list[list[str]] = []

    def take(delta: StreamDelta | None) -> None:
        if delta is None:
            return
        assert delta.content or delta.tool_calls, "an empty delta is None"
        content.append(delta.content or "")
        for tc in delta.tool_calls:
            if tc.index == len(calls):  # a call's first delta: id, type, name
                assert tc.id.startswith("chatcmpl-tool-") and tc.type == "function"
                assert tc.function.name is not None and tc.function.arguments is not None
                calls.append([tc.function.name, tc.function.arguments])
            else:  # later: index and an arguments piece only
                assert tc.index == len(calls) - 1, "deltas of an earlier call after a later one"
                assert tc.id is None and tc.type is None and tc.function.name is None
                assert tc.function.arguments
                calls[tc.index][1] += tc.function.arguments

    previous = ""
    for piece in pieces:
        take(parser.extract_tool_calls_streaming(previous, previous + piece, piece))
        previous += piece
    take(parser.finish_streaming())
    return "".join(content), [tuple(c) for c in calls]


def check(name: str, text: str, content: str | None, calls: list[tuple[str, object]]):
    """The whole-output result is (content, calls) -- arguments given as the parsed value --
    and every chunking of the stream reassembles to it."""
    result = get_tool_parser(name)(None).extract_tool_calls(text)
    assert isinstance(result, ExtractedToolCalls)
    assert result.content == content
    assert result.tools_called == bool(calls)
    got = [(c.function.name, c.function.arguments) for c in result.tool_calls]
    assert got == [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]
    for c in result.tool_calls:
        assert c.type == "function" and c.id.startswith("chatcmpl-tool-")
    for pieces in chunkings(text):
        assert stream(get_tool_parser(name), pieces) == (content or "", got), pieces


WEATHER = {"city": "Paris", "unit": "celsius"}
TRICKY = {"q": "é \"quoted\" \\ back\nline\t😀 \x01",
          "n": [1.5, 1000.0, -0, 0.25, 12345678901234567890],
          "ok": True, "none": None, "nested": {"a": [], "b": {}, "c": [{"d": "</tool_call>?"}]}}
TRICKY_RAW = ('{"q": "\\u00e9 \\"quoted\\" \\\\ back\\nline\\t\\ud83d\\ude00 \\u0001", '
              '"n":[1.50,1e3,-0,2.5E-1,12345678901234567890],"ok":true,"none":null,'
              '"nested":{"a":[ ],"b":{},"c":[{"d":"<\\/tool_call>?"}]}}')


def hermes_block(obj: str) -> str:
    return f"<tool_call>\n{obj}\n</tool_call>"


@pytest.mark.parametrize("text, content, calls", [
    ("Hello! No tools < here, <tool and <tool_cal", "Hello! No tools < here, <tool and <tool_cal",
     []),
    ("", "", []),
    (hermes_block('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'),
     None, [("get_weather", WEATHER)]),
    ("I'll check the weather.\n" + hermes_block(
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'),
     "I'll check the weather.\n", [("get_weather", WEATHER)]),
    ("Two calls:" + hermes_block('{"name": "a", "arguments": {}}') + "\n"
     + hermes_block('{"arguments": {"x": [1, 2]}, "name": "b"}') + " trailing text",
     "Two calls:", [("a", {}), ("b", {"x": [1, 2]})]),
    (hermes_block('{"name": "tricky", "arguments": ' + TRICKY_RAW + "}"), None,
     [("tricky", TRICKY)]),
    ("<tool_call>{\"name\": \"f\", \"arguments\": \"a string\"}", None, [("f", "a string")]),
    ("x<tool_call>{\"name\":\"f\",\"arguments\":{\"k\":1}}</tool_call><tool_call>"
     "{\"name\":\"g\",\"arguments\":{}}", "x", [("f", {"k": 1}), ("g", {})]),
])
def test_hermes(text, content, calls):
    check("hermes", text, content, calls)


@pytest.mark.parametrize("text", [
    "Let me see <tool_call>{\"name\": oops}</tool_call>",  # not JSON
    "<tool_call>{\"name\": \"f\"}</tool_call>",  # no arguments
    "<tool_call>{\"name\": 3, \"arguments\": {}}</tool_call>",  # the name is not a string
    "<tool_call></tool_call>",
    "<tool_call>[1, 2]</tool_call>",
    "text <tool_call>{\"name\": \"f\", \"argu",  # cut off before the arguments begin
])
def test_hermes_malformed_is_content(text):
    check("hermes", text, text, [])


def test_hermes_later_malformed_call():
    """Non-streaming: all content (vLLM). Streaming cannot take back the first call: it is
    sent, and the stream's tool calls end at the broken one."""
    text = hermes_block('{"name": "a", "arguments": {}}') + "<tool_call>{bad}</tool_call>"
    parser = get_tool_parser("hermes")
    result = parser(None).extract_tool_calls(text)
    assert (result.tools_called, result.content) == (False, text)
    for pieces in chunkings(text, seeds=2):
        assert stream(parser, pieces) == ("", [("a", "{}")])


@pytest.mark.parametrize("text, content, calls", [
    ("The weather is nice.", "The weather is nice.", []),
    ("   ", "   ", []),
    ("<|python_tag|>", "<|python_tag|>", []),
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
     [("get_weather", WEATHER)]),
    (' \n<|python_tag|> {"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius"}}', None, [("get_weather", WEATHER)]),
    ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": ' + TRICKY_RAW + '} ;'
     '{"parameters": {}, "name": "c"} and some trailing text', None,
     [("a", {"x": 1}), ("b", TRICKY), ("c", {})]),
    ('{"name": "a", "parameters": {}};{"na', None, [("a", {})]),  # a later call cut off
    ('{"name": "a", "parameters": {}}; then text', None, [("a", {})]),
    ('{"answer": 42} is my JSON reply', '{"answer": 42} is my JSON reply', []),
    ('Sure: {"name": "a", "parameters": {}}', 'Sure: {"name": "a", "parameters": {}}', []),
    ('{"name": "a" "parameters": {}}', '{"name": "a" "parameters": {}}', []),
    ('{"name": "a", "param', '{"name": "a", "param', []),
])
def test_llama3_json(text, content, calls):
    check("llama3_json", text, content, calls)


def test_canonicalizer_matches_json_dumps_at_every_prefix():
    """`parts` is a prefix of json.dumps(json.loads(...), ensure_ascii=False) after every
    character, and all of it once the object closes."""
    text = '{"name": "t", "arguments": ' + TRICKY_RAW + ', "z": [true, false, NaN, -Infinity]}'
    final = json.dumps(json.loads(text), ensure_ascii=False)
    canon = JsonCanonicalizer()
    for ch in text:
        assert canon.feed(ch) == 1
        assert final.startswith("".join(canon.parts))
    assert canon.done and "".join(canon.parts) == final
    start, end = canon.spans["arguments"]
    assert "".join(canon.parts[start:end]) == json.dumps(TRICKY, ensure_ascii=False)
    assert canon.feed("  more") == 0


@pytest.mark.parametrize("bad", ['{"a" 1}', '{"a": 1,}', '{"a": tru }', '{"a": "x\ny"}',
                                 '{"a": "\\x"}', '{"a": "\\u12g4"}', '{"a": 01}'])
def test_canonicalizer_refuses_what_json_loads_refuses(bad):
    with pytest.raises(ValueError):
        json.loads(bad)
    canon = JsonCanonicalizer()
    canon.feed(bad)
    assert canon.error


def test_canonicalizer_root_is_an_object():
    canon = JsonCanonicalizer()
    canon.feed("[1]")
    assert canon.error


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_tool_parser("nope")


def test_models_dump_as_openai():
    call = ToolCall(function={"name": "f", "arguments": "{}"})
    assert call.model_dump() == {"id": call.id, "type": "function",
                                 "function": {"name": "f", "arguments": "{}"}}
    assert len(call.id) == len("chatcmpl-tool-") + 32
    assert ToolCall(function={"name": "f", "arguments": "{}"}).id != call.id
