"""openai/structured_outputs.py: every request field that constrains the output, one at a time,
and the errors that name the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from mrv2.config import StructuredOutputsConfig
from mrv2.entrypoints.openai.errors import BadRequest
from mrv2.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from mrv2.entrypoints.openai.structured_outputs import request_structured_outputs

CONFIG = StructuredOutputsConfig()
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "time"}}]


def chat(**fields):
    return request_structured_outputs(ChatCompletionRequest.model_validate({**CHAT, **fields}),
                                      CONFIG)


def test_free_text_has_no_constraint():
    assert chat() is None
    assert chat(response_format={"type": "text"}) is None
    assert chat(tools=TOOLS, tool_choice="none") is None
    assert chat(tools=TOOLS, tool_choice="auto") is None


@pytest.mark.parametrize("fields, kind, value", [
    ({"response_format": {"type": "json_object"}}, "json_object", True),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json", SCHEMA),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, "json", SCHEMA),
    ({"guided_json": SCHEMA}, "json", SCHEMA),
    ({"guided_regex": "a|b"}, "regex", "a|b"),
    ({"guided_choice": ["a", "b"]}, "choice", ["a", "b"]),
    ({"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"'),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, "json", SCHEMA),
])
def test_each_source(fields, kind, value):
    params = chat(**fields)
    assert params.kind == kind and getattr(params, kind) == value
    completion = CompletionRequest.model_validate({"prompt": "x", **fields})
    assert request_structured_outputs(completion, CONFIG) == params


def test_structured_outputs_flags_reach_the_params():
    params = chat(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True,
                                      "disable_additional_properties": True})
    assert params.disable_any_whitespace and params.disable_additional_properties


def test_structural_tag_formats():
    new = chat(response_format={"type": "structural_tag", "format": {
        "type": "const_string", "value": "hi"}})
    assert json.loads(new.structural_tag)["format"]["value"] == "hi"
    old = chat(response_format={"type": "structural_tag", "triggers": ["<f="],
                                "structures": [{"begin": "<f=a>", "schema": SCHEMA,
                                                "end": "</f>"}]})
    fmt = json.loads(old.structural_tag)["format"]
    assert fmt["type"] == "triggered_tags" and fmt["tags"][0]["begin"] == "<f=a>"


def test_tool_choice_required_schema():
    params = chat(tools=TOOLS, tool_choice="required")
    calls = [{"name": "weather", "parameters": {"city": "Oslo"}},
             {"name": "time", "parameters": {}}]
    jsonschema.validate(calls, params.json)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "weather"}],
                [{"name": "weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, params.json)
    single = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert single.json["maxItems"] == 1


def test_named_tool_choice_is_its_parameters():
    named = {"type": "function", "function": {"name": "weather"}}
    assert chat(tools=TOOLS, tool_choice=named).json == SCHEMA
    untyped = {"type": "function", "function": {"name": "time"}}
    assert chat(tools=TOOLS, tool_choice=untyped).json == {"type": "object"}


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
     "response_format"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " *"}}, "structured_outputs"),
    ({"guided_json": "{nope"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
])
def test_bad_constraints_name_the_field(fields, param):
    with pytest.raises(BadRequest) as info:
        chat(**fields)
    assert info.value.param == param
