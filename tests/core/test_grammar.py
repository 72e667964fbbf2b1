"""core/grammar.py: constraint -> xgrammar grammar, validation messages, compilation."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import xgrammar as xgr

from mrv2.config import StructuredOutputsConfig
from mrv2.core.grammar import (
    GrammarCompiler,
    GrammarError,
    grammar_key,
    validate_structured_outputs,
)
from mrv2.models.tokenizer import load_tokenizer
from mrv2.sampling_params import StructuredOutputsParams as Params

CONFIG = StructuredOutputsConfig()
# RFC 8259: a JSON string holds U+0000-U+001F, '"' and '\\' only escaped (json.loads refuses
# them raw); every other character may stand raw, DEL and the line separators included.
MUST_ESCAPE = [chr(c) for c in range(0x20)] + ['"', "\\"]
MAY_STAND_RAW = ["\x7f", "\x85", "\xa0", "\u2028", "\u2029", "\ufeff", "é", "😀", "/", "'"]


@pytest.fixture(scope="module")
def compiler(tiny_llama):
    tokenizer = load_tokenizer(str(tiny_llama))
    return tokenizer, GrammarCompiler(tokenizer, 2048 + 64, [1], CONFIG)


def accepts(compiler, params: Params, text: str) -> bool:
    """Whether the compiled grammar accepts `text` followed by its stop token."""
    tokenizer, grammar_compiler = compiler
    matcher = xgr.GrammarMatcher(grammar_compiler.compile(params))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(1)


def test_choice_escapes_quotes_and_backslashes(compiler):
    params = Params(choice=['a "b"', "c\\d", "é"])
    assert accepts(compiler, params, 'a "b"') and accepts(compiler, params, "c\\d")
    assert accepts(compiler, params, "é") and not accepts(compiler, params, "a")


def test_json_keeps_property_order_and_whitespace_setting(compiler):
    schema = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "integer"}},
              "required": ["z", "a"]}
    compact = Params(json=schema, disable_any_whitespace=True)
    assert accepts(compiler, compact, '{"z": 1, "a": 2}')
    assert not accepts(compiler, compact, '{"a": 2, "z": 1}')
    assert not accepts(compiler, compact, '{ "z": 1, "a": 2}')
    assert accepts(compiler, Params(json=json.dumps(schema)), '{ "z" :1,\n "a": 2}')
    # The engine-wide setting applies to every request.
    engine_wide = StructuredOutputsConfig(disable_any_whitespace=True)
    assert grammar_key(Params(json=schema), engine_wide)[2] is False


def test_disable_additional_properties_fills_in_every_object():
    schema = {"type": "object", "properties": {"o": {"type": "object", "properties": {}},
                                              "p": {"type": "object",
                                                    "additionalProperties": True}}}
    _, source, _ = grammar_key(Params(json=schema, disable_additional_properties=True), CONFIG)
    out = json.loads(source)
    assert out["additionalProperties"] is False
    assert out["properties"]["o"]["additionalProperties"] is False
    assert out["properties"]["p"]["additionalProperties"] is True  # said: kept
    assert "additionalProperties" not in json.loads(grammar_key(Params(json=schema),
                                                                CONFIG)[1])


def test_json_object_is_an_object(compiler):
    params = Params(json_object=True)
    assert accepts(compiler, params, '{"k": [1, 2]}')
    assert not accepts(compiler, params, "[1, 2]")


def test_lark_and_ebnf_are_told_apart(compiler):
    assert accepts(compiler, Params(grammar='start: "x" NUM\nNUM: /[0-9]+/'), "x12")
    assert accepts(compiler, Params(grammar='root ::= "x" [0-9]+'), "x12")


@pytest.mark.parametrize("params, field, why", [
    (Params(json={"type": "objectx"}), "json", "Unsupported type"),
    (Params(json="{nope"), "json", "not valid JSON"),
    (Params(regex="a(b"), "regex", "parenthesis"),
    (Params(grammar='root ::= "a" |'), "grammar", "EBNF"),
    (Params(grammar="start: undefined_rule"), "grammar", ""),
    (Params(structural_tag="{}"), "structural_tag", ""),
    (Params(json={"type": "string", "pattern": "(é"}), "json", ""),
])
def test_invalid_constraints_name_the_field(params, field, why):
    with pytest.raises(GrammarError, match=f"structured_outputs.{field}") as info:
        validate_structured_outputs(params, CONFIG)
    assert why in str(info.value)
    assert "/project/" not in str(info.value)  # xgrammar's C++ source location is cut


def test_valid_constraints_pass_validation():
    for params in (Params(json={"type": "string"}), Params(regex="[a-z]+"),
                   Params(choice=["a"]), Params(json_object=True),
                   Params(grammar='root ::= "a"')):
        validate_structured_outputs(params, CONFIG)


def test_model_vocab_wider_than_tokenizer(compiler):
    """Logits wider than the tokenizer's vocabulary: the padding ids are never allowed."""
    _, grammar_compiler = compiler
    matcher = xgr.GrammarMatcher(grammar_compiler.compile(Params(regex="[a-z]+")))
    bitmask = np.zeros(xgr.get_bitmask_shape(1, grammar_compiler.vocab_size), np.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:grammar_compiler.vocab_size]
    assert bits[:2048].any() and not bits[2048:].any()


def test_compiled_grammar_cache_stays_within_its_bound(compiler):
    tokenizer, unbounded = compiler
    limit = 256 << 10
    bounded = GrammarCompiler(tokenizer, 2048 + 64, [1], CONFIG, cache_limit_bytes=limit)
    for i in range(60):  # distinct schemas, as a fuzzer sends them
        schema = {"type": "object", "properties": {f"field_{i}_{j}": {"type": "integer"}
                                                   for j in range(8)}}
        for grammar_compiler in (bounded, unbounded):
            grammar_compiler.compile(Params(json=json.dumps(schema)))
    assert unbounded.cache_size_bytes > 4 * limit  # the test's schemas would exceed it
    # xgrammar evicts once past the bound, so it may exceed it by about one grammar.
    assert bounded.cache_size_bytes <= 1.25 * limit


def string_value(schema: dict) -> Params:
    return Params(json={"type": "object", "properties": {"s": schema}, "required": ["s"]})


STRING_VALUE = '{"s": %s}'
TAG = json.dumps({"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<f="], "tags": [{
        "begin": "<f=a>", "end": "</f>",
        "content": {"type": "json_schema", "json_schema": {
            "type": "object", "properties": {"s": {"type": "string", "maxLength": 8}}}}}]}})
# A constraint and the text around a JSON string in an output it allows.
STRICT_CASES = {
    "string": (string_value({"type": "string"}), STRING_VALUE),
    "bounded string": (string_value({"type": "string", "minLength": 1, "maxLength": 8}),
                       STRING_VALUE),
    "json_object": (Params(json_object=True), STRING_VALUE),
    "non-ASCII pattern": (string_value({"type": "string", "pattern": "^é.{1,3}$"}), STRING_VALUE),
    "pattern key": (Params(json={"type": "object", "patternProperties": {
        "^é.*$": {"type": "integer"}}, "additionalProperties": False}), '{%s: 1}'),
    "structural tag": (Params(structural_tag=TAG), 'call <f=a>{"s": %s}</f>'),
}


@pytest.mark.parametrize("case", STRICT_CASES)
def test_json_strings_are_strict_json(compiler, case):
    """Every control character, quote and backslash only escaped (as json.dumps writes it, and
    as \\uXXXX); every other character raw too. xgrammar's rule for a bounded string, and its
    rules for a pattern it cannot make a JSON-string regex of, took raw control characters."""
    params, around = STRICT_CASES[case]
    for char in MUST_ESCAPE:
        escaped = json.dumps(f"é{char}", ensure_ascii=False)
        assert not accepts(compiler, params, around % f'"é{char}"'), (case, char)
        assert accepts(compiler, params, around % escaped), (case, char)
        assert accepts(compiler, params, around % f'"é\\u{ord(char):04x}"'), (case, char)
    for char in MAY_STAND_RAW:
        assert accepts(compiler, params, around % f'"é{char}"'), (case, char)


@pytest.mark.parametrize("pattern, value", [
    ("^[\\t\\n]{1,3}$", "\t\n"),  # only characters a JSON string escapes
    ('^a"b$', 'a"b'),
    ("^x\\\\d$", "x\\d"),  # a backslash, then "d"
    ("^ü[\\x00-\\x1f]$", "ü\x00"),
])
def test_patterns_of_characters_json_escapes(compiler, pattern, value):
    """xgrammar writes these patterns as rules over raw characters: now their JSON strings
    are the escaped spellings of a value that matches."""
    params = string_value({"type": "string", "pattern": pattern})
    assert re.fullmatch(pattern, value)
    assert accepts(compiler, params, STRING_VALUE % json.dumps(value, ensure_ascii=False))
    assert not accepts(compiler, params, STRING_VALUE % f'"{value}"')
