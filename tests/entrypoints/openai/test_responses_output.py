"""Output items and stream events from chat message deltas: the events are what the openai
client's types accept, and streamed pieces build the same items as the whole message."""

from __future__ import annotations

import pytest
from openai.types.responses import ResponseOutputItem, ResponseStreamEvent
from pydantic import TypeAdapter

from mrv2.entrypoints.openai.responses_output import (ResponseOutput, reasoning_token_count,
                                                      whole_message_delta)

EVENTS = TypeAdapter(ResponseStreamEvent)
ITEMS = TypeAdapter(ResponseOutputItem)
CALL = {"id": "chatcmpl-tool-1", "type": "function",
        "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
MESSAGE = {"reasoning": "Let me think.", "content": "It is noon.", "tool_calls": [CALL]}
STREAMED = [{"reasoning": "Let me "}, {"reasoning": "think."}, {"content": "It is "},
            None, {"content": "noon."},
            {"tool_calls": [{"index": 0, "id": "chatcmpl-tool-1", "type": "function",
                             "function": {"name": "get_time", "arguments": ""}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"zone": '}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": '"UTC"}'}}]}]


def run(deltas: list, status: str = "completed") -> tuple[ResponseOutput, list[dict]]:
    output = ResponseOutput()
    events = [e for delta in deltas for e in output.feed(delta)] + output.close(status)
    for number, event in enumerate(events):
        EVENTS.validate_python({**event, "sequence_number": number})  # the client's types
    return output, events


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


def test_streamed_pieces_build_the_whole_messages_items():
    whole, _ = run([whole_message_delta(MESSAGE)])
    streamed, events = run(STREAMED)
    assert without_ids(streamed.items) == without_ids(whole.items)
    reasoning, message, call = whole.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert message["content"][0]["text"] == "It is noon." and message["role"] == "assistant"
    assert (call["call_id"], call["name"], call["arguments"]) == (
        "chatcmpl-tool-1", "get_time", '{"zone": "UTC"}')
    assert [i["id"][:3] for i in whole.items] == ["rs_", "msg", "fc_"]
    for item in whole.items:
        ITEMS.validate_python(item)
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done"]
    assert [e["output_index"] for e in events if "item" in e] == [0, 0, 1, 1, 2, 2]
    # The added events show the item as it was then, the done events as it ends.
    assert events[0]["item"]["content"] == [] and events[0]["item"]["status"] == "in_progress"
    assert events[6]["item"] == streamed.items[0]


def test_the_last_item_gets_the_responses_status():
    output, events = run([{"content": "a"}, {"tool_calls": [{"index": 0, **CALL}]},
                          {"content": "b"}], status="incomplete")
    assert [(i["type"], i["status"]) for i in output.items] == [
        ("message", "completed"), ("function_call", "completed"), ("message", "incomplete")]
    assert events[-1]["item"]["status"] == "incomplete"
    assert ResponseOutput().close("completed") == [] and ResponseOutput().feed(None) == []


@pytest.mark.parametrize("reasoning, token_ids, end, expected", [
    ("ab", [5, 6, 99, 7], 99, 2),  # the end marker is an output token: the tokens before it
    ("ab", [5, 6, 7, 8], None, 2),  # a marker of several tokens: the text's tokens (`count`)
    ("abcde", [5, 6, 7], 99, 3),  # ... never more than the output
])
def test_reasoning_token_count(reasoning, token_ids, end, expected):
    items = run([{"reasoning": reasoning}, {"content": "c"}])[0].items
    assert reasoning_token_count(items, token_ids, end, len) == expected
    no_reasoning = run([{"content": "c"}])[0].items
    assert reasoning_token_count(no_reasoning, token_ids, end, len) == 0
