"""openai/structured_outputs.py: every request field that constrains the output, one at a time,
and the errors that name the field; tool calls forced by tool_choice are strict JSON."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr

from mrv2 import LLM, SamplingParams
from mrv2.config import StructuredOutputsConfig
from mrv2.core.grammar import GrammarCompiler
from mrv2.entrypoints.openai.errors import BadRequest
from mrv2.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from mrv2.entrypoints.openai.structured_outputs import request_structured_outputs
from mrv2.models.tokenizer import load_tokenizer
from mrv2.sampling_params import StructuredOutputsParams

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


# Tools whose every string is bounded, so that a random-weight model's call can end within its
# tokens; a bounded string is where xgrammar 0.2 let raw control characters in.
BOUNDED_TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10},
                       "days": {"type": "integer", "minimum": 1, "maximum": 14},
                       "unit": {"enum": ["c", "f"]}}}}},
    {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "required": ["text"],
        "properties": {"text": {"type": "string", "maxLength": 12}}}}},
]
TOOL_CHOICES = {"required": {"tool_choice": "required", "parallel_tool_calls": False},
                "named": {"tool_choice": {"type": "function", "function": {"name": "weather"}}}}


def forced_tool_call(choice: str):
    """The constraint of a request with BOUNDED_TOOLS and TOOL_CHOICES[choice], without free
    whitespace (as the server tests run: a random model would spend its tokens on it)."""
    schema = chat(tools=BOUNDED_TOOLS, **TOOL_CHOICES[choice]).json
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def check_tool_call(choice: str, text: str) -> None:
    """`text` parses as strict JSON, and every call's arguments validate against its tool's."""
    value = json.loads(text)  # strict: no raw control character in a string
    calls = value if choice == "required" else [{"name": "weather", "parameters": value}]
    assert calls and (choice == "named" or len(calls) == 1), text
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED_TOOLS}
    for call in calls:
        jsonschema.validate(call["parameters"], schemas[call["name"]])


@pytest.mark.parametrize("choice", TOOL_CHOICES)
def test_forced_tool_call_strings_are_strict_json(tiny_llama, choice):
    """The arguments' grammar: every control character, quote and backslash in a string only
    escaped (xgrammar's rule for a bounded string took U+0000-U+001F raw, CR and LF aside)."""
    tokenizer = load_tokenizer(str(tiny_llama))
    compiler = GrammarCompiler(tokenizer, 2048, [1], CONFIG)
    compiled = compiler.compile(forced_tool_call(choice))
    around = ('[{"name": "note", "parameters": {"text": %s}}]' if choice == "required"
              else '{"city": %s, "days": 3}')

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(1)

    for char in [chr(c) for c in range(0x20)] + ['"', "\\"]:
        assert not accepts(around % f'"a{char}"'), (choice, char)
        assert accepts(around % json.dumps(f"a{char}")), (choice, char)
    assert accepts(around % '"a\x7f\u2028é"')


SEEDS = 32
TEMPERATURES = (0.7, 1.0, 1.5)


def test_forced_tool_calls_parse_and_validate_over_many_seeds(tiny_llama):
    """A random-weight model sampled hot writes wild strings; every call that ends parses with a
    strict json.loads and validates against its tool's schema, for both forced choices."""
    llm = LLM(str(tiny_llama), max_model_len=256, max_num_seqs=2 * SEEDS)
    batch = [SamplingParams(temperature=TEMPERATURES[seed % len(TEMPERATURES)], seed=seed,
                            max_tokens=48, structured_outputs=forced_tool_call(choice))
             for choice in TOOL_CHOICES for seed in range(SEEDS)]
    outs = llm.generate(["def main():"] * len(batch), batch, use_tqdm=False)
    for i, choice in enumerate(TOOL_CHOICES):
        done = [o.outputs[0].text for o in outs[i * SEEDS:(i + 1) * SEEDS]
                if o.outputs[0].finish_reason == "stop"]
        assert len(done) >= SEEDS // 2, (choice, len(done))
        for text in done:
            check_tool_call(choice, text)
