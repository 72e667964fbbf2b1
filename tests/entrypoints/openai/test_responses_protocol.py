"""The Responses request: parsing (a bad item is a 400 naming its field), what is refused by
name, the chat request it becomes, and the fields a response echoes."""

from __future__ import annotations

import json

import pytest

from mrv2.entrypoints.openai.errors import BadRequest
from mrv2.entrypoints.openai.protocol import NamedToolChoice
from mrv2.entrypoints.openai.responses_protocol import ResponsesRequest

TOOL = {"type": "function", "name": "get_time", "description": "Now",
        "parameters": {"type": "object"}, "strict": True}


def parse(**fields) -> ResponsesRequest:
    """The request with these fields (input "hi" unless given), parsed from JSON."""
    fields.setdefault("input", "hi")
    return ResponsesRequest.model_validate_json(json.dumps(fields))


def test_the_chat_request_it_runs_as():
    request = parse(instructions="Be brief.", max_output_tokens=7, temperature=0.5, top_p=0.9,
                    tools=[TOOL], tool_choice={"type": "function", "name": "get_time"},
                    parallel_tool_calls=False, top_k=3, text={"format": {
                        "type": "json_schema", "name": "n", "schema": {"type": "object"},
                        "strict": True}})
    chat = request.to_chat_request([{"role": "user", "content": "hi"}])
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert chat.messages[0].content == "Be brief."
    assert chat.max_completion_tokens == 7 and chat.temperature == 0.5 and chat.top_k == 3
    assert chat.tool_choice == NamedToolChoice(function={"name": "get_time"})
    assert chat.tools[0].function.name == "get_time" and chat.tools[0].function.strict
    assert chat.parallel_tool_calls is False
    assert chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    plain = parse(text={"format": {"type": "text"}}).to_chat_request([{"role": "user",
                                                                        "content": "hi"}])
    assert plain.response_format is None and plain.tools is None and len(plain.messages) == 1


def test_echo():
    echo = parse(tools=[TOOL], metadata={"k": "v"}, user="u").echo()
    assert echo["tools"] == [TOOL] and echo["tool_choice"] == "auto"
    assert echo["metadata"] == {"k": "v"} and echo["user"] == "u" and echo["store"] is True
    assert echo["text"] == {"format": {"type": "text"}} and echo["truncation"] == "disabled"
    named = parse(tools=[TOOL], tool_choice={"type": "function", "name": "get_time"}).echo()
    assert named["tool_choice"] == {"type": "function", "name": "get_time"}


@pytest.mark.parametrize("fields, param", [
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input.0.call_id"),
    ({"tools": [{"type": "function"}]}, "tools.0.name"),
])
def test_a_bad_item_names_its_field(fields, param):
    with pytest.raises(BadRequest) as caught:
        parse(**fields)
    assert caught.value.param == param and caught.value.message.startswith(param)


@pytest.mark.parametrize("fields, param", [
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "p"}}, "prompt"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format"),
])
def test_what_is_not_implemented_is_refused_by_name(fields, param):
    request = parse(**fields)
    with pytest.raises(BadRequest) as caught:
        request.check()
    assert caught.value.param == param


def test_defaults_and_ignored_fields(caplog):
    request = parse(temperature=None, unknown_field=1, stream_options=None)
    assert request.store is True and request.parallel_tool_calls is True
    assert request.temperature is None and request.stream is False
    request.check()
    assert "unknown_field" in caplog.text


def test_its_json_schema_builds_outside_fastapi():
    """pydantic's own schema (refs under #/$defs, as a client generator or a test reading the
    model asks for it) resolves every ref; tool_choice shows what is served and no bare object
    (other tool kinds' choices are refused by name, not described)."""
    schema = ResponsesRequest.model_json_schema()
    choice = schema["properties"]["tool_choice"]["anyOf"]
    assert {"enum": ["none", "auto", "required"], "type": "string"} in choice
    assert {"$ref": "#/$defs/FunctionToolChoice"} in choice and {"type": "null"} in choice
    assert len(choice) == 3 and "FunctionToolChoice" in schema["$defs"]
    refs = [ref for ref in json.dumps(schema).split('"$ref": "')[1:]]
    assert all(ref.startswith("#/$defs/") and ref.split('"')[0][8:] in schema["$defs"]
               for ref in refs)
