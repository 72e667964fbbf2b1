"""What /openapi.json says beyond the request models' types, so that a schema-valid body is
never a 400 (schemathesis's positive_data_acceptance) and a schema-driven client sends only
what the server serves.

- The token-id and logit_bias types (TokenId, LogitBias), whose schemas carry marks, and the
  marks the models put in their JSON schema, filled in per server by `fill_model_bounds`
  (answer_schemas.install_openapi): a token id's maximum is the served vocabulary size - 1
  and a logit_bias key's pattern the decimal numbers below it (TOKEN_ID_MARK); a token
  budget's maximum is the context length - 1 (CONTEXT_MARK: what the prompt leaves of the
  context is checked per request, a 400 beyond it).
- The handlers' cross-field rules as JSON Schema (`not` / `oneOf` subschemas).
- `OnlyNull`: a declared field whose every value is refused by name shows only null.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, Strict, StrictInt, WithJsonSchema

from mrv2.sampling_params import SAMPLING_RANGES

INT64_MAX = 2**63 - 1
TOKEN_ID_MARK = "x-mrv2-token-id"
CONTEXT_MARK = "x-mrv2-context"
BUDGET = {CONTEXT_MARK: True}


def _integral_float_to_int(value: Any) -> Any:
    """JSON's 5.0 is the integer 5 (as JSON Schema reads it); 5.5, "5" and true stay refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# JSON's numbers as the schema types them: pydantic's lax mode would also take "5", "0.5"
# and true / false where an integer or a number is declared (schemathesis's negative mode sent
# them and saw a 200).
JsonInt = Annotated[StrictInt, BeforeValidator(_integral_float_to_int)]
JsonFloat = Annotated[float, Strict()]  # an integer is a number too
# JsonInt's parts, the bounds before the validator: so they render as minimum / maximum in the
# items of the lists a token id appears in (protocol_base renames bounds on properties only).
TokenId = Annotated[StrictInt,
                    Field(ge=0, le=INT64_MAX, json_schema_extra={TOKEN_ID_MARK: "integer"}),
                    BeforeValidator(_integral_float_to_int)]
LogitBias = Annotated[dict[str, JsonFloat],
                      Field(json_schema_extra={"propertyNames": {TOKEN_ID_MARK: "string"}})]

OnlyNull = WithJsonSchema({"type": "null"})
# Stop strings: SamplingParams refuses an empty one (as vLLM does), so the schema says so.
StopStrings = Annotated[str | list[str] | None, WithJsonSchema({"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}}, {"type": "null"}]})]


def sampling_range(name: str) -> Any:
    """A sampling field of default None whose schema states the range SamplingParams accepts.
    SamplingParams enforces it (its 400 names the field and the range)."""
    return Field(None, json_schema_extra=SAMPLING_RANGES[name].json_schema)

_TOKEN_ID_SCHEMA = {"type": "integer", "minimum": 0, TOKEN_ID_MARK: "integer"}
# A completion prompt in any of its four forms, never empty.
NON_EMPTY_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    {"type": "array", "minItems": 1, "items": _TOKEN_ID_SCHEMA},
    {"type": "array", "minItems": 1,
     "items": {"type": "array", "minItems": 1, "items": _TOKEN_ID_SCHEMA}}]}


def _when_type(value: str, then: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema: `then` holds for an object whose "type" is `value`."""
    return {"if": {"properties": {"type": {"const": value}}, "required": ["type"]},
            "then": then}


_HAS_SCHEMA = {"required": ["schema"], "properties": {"schema": {"type": "object"}}}
# A Responses text.format of type json_schema needs its schema (a 400 without it).
FORMAT_RULES = _when_type("json_schema", _HAS_SCHEMA)
# A chat response_format carries what its type needs (the handler's 400 otherwise): json_schema
# its json_schema.schema; structural_tag xgrammar's `format`, or non-empty `structures` with
# `triggers`.
RESPONSE_FORMAT_RULES = {"allOf": [
    _when_type("json_schema", {"required": ["json_schema"], "properties": {
        "json_schema": {"type": "object", **_HAS_SCHEMA}}}),
    _when_type("structural_tag", {"anyOf": [
        {"required": ["format"], "properties": {"format": {"type": "object"}}},
        {"required": ["structures", "triggers"],
         "properties": {"structures": {"type": "array", "minItems": 1},
                        "triggers": {"type": "array"}}}]})]}
# A tool_choice other than "none" (or unset) needs tools.
TOOL_CHOICE_NEEDS_TOOLS = {"not": {"required": ["tool_choice"], "properties": {
    "tool_choice": {"not": {"anyOf": [{"const": "none"}, {"type": "null"}]}},
    "tools": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}}}}
# add_generation_prompt (default true) and continue_final_message cannot both be true.
GENERATION_PROMPT_OR_CONTINUE = {"not": {
    "required": ["continue_final_message"],
    "properties": {"continue_final_message": {"const": True},
                   "add_generation_prompt": {"not": {"const": False}}}}}
# stream_options only with "stream": true (the handlers' 400 otherwise).
STREAM_OPTIONS_NEED_STREAM = {"not": {"required": ["stream_options"], "properties": {
    "stream_options": {"not": {"type": "null"}}, "stream": {"not": {"const": True}}}}}
# The rules of the fields completions and chat share (protocol.SamplingRequest).
SAMPLING_RULES = STREAM_OPTIONS_NEED_STREAM
CHAT_RULES = {"allOf": [GENERATION_PROMPT_OR_CONTINUE, TOOL_CHOICE_NEEDS_TOOLS, SAMPLING_RULES]}
# Exactly one of prompt and messages (non-null); the chat template's flags as in chat.
TOKENIZE_RULES = {"oneOf": [
    {"required": ["prompt"],
     "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
    {"required": ["messages"],
     "properties": {"messages": {"type": "array", "minItems": 1}, "prompt": {"type": "null"}},
     **GENERATION_PROMPT_OR_CONTINUE}]}
# A response needs a conversation: without instructions or a previous response, the input is
# a string or holds an item that is not a reasoning item (those are dropped).
RESPONSES_INPUT_HOLDS_A_MESSAGE = {"anyOf": [
    {"required": ["instructions"], "properties": {"instructions": {"minLength": 1}}},
    {"required": ["previous_response_id"],
     "properties": {"previous_response_id": {"type": "string"}}},
    {"properties": {"input": {"anyOf": [{"type": "string"}, {"type": "array", "contains": {
        "not": {"required": ["type"], "properties": {"type": {"const": "reasoning"}}}}}]}}}]}
RESPONSES_RULES = {"allOf": [TOOL_CHOICE_NEEDS_TOOLS, RESPONSES_INPUT_HOLDS_A_MESSAGE,
                             STREAM_OPTIONS_NEED_STREAM]}
# Without a tool-call parser, tools with tool_choice "auto" (the default) are refused.
NO_AUTO_TOOL_CHOICE = {"not": {"required": ["tools"], "properties": {
    "tools": {"type": "array", "minItems": 1},
    "tool_choice": {"anyOf": [{"const": "auto"}, {"type": "null"}]}}}}


def decimal_below_pattern(limit: int) -> str:
    """A regex matching exactly the decimal numbers 0 .. limit - 1 (no sign, no leading
    zeros): a logit_bias key's form, as a JSON schema pattern."""
    top = str(limit - 1)
    if len(top) == 1:
        return f"^[0-{top}]$"
    parts = ["0", f"[1-9][0-9]{{0,{len(top) - 2}}}"]  # the numbers of fewer digits
    for i, digit in enumerate(top):  # same length: top's prefix, then a smaller digit
        low = 1 if i == 0 else 0
        if int(digit) > low:
            rest = len(top) - i - 1
            tail = f"[0-9]{{{rest}}}" if rest else ""
            parts.append(top[:i] + f"[{low}-{int(digit) - 1}]" + tail)
    parts.append(top)
    return "^(" + "|".join(parts) + ")$"


def fill_model_bounds(node: Any, vocab_size: int | None, max_model_len: int | None) -> None:
    """Replaces each TOKEN_ID_MARK with the vocabulary's bound (an integer's maximum, a string
    key's pattern) and each CONTEXT_MARK with the context's, in place; without a model the
    marks just go."""
    if isinstance(node, list):
        for item in node:
            fill_model_bounds(item, vocab_size, max_model_len)
    elif isinstance(node, dict):
        if node.pop(CONTEXT_MARK, None) and max_model_len is not None:
            node["maximum"] = max_model_len - 1
        kind = node.pop(TOKEN_ID_MARK, None)
        if kind == "integer" and vocab_size is not None:
            node["maximum"] = vocab_size - 1
        elif kind == "string":
            node["type"] = "string"
            node["pattern"] = (decimal_below_pattern(vocab_size) if vocab_size is not None
                               else "^(0|[1-9][0-9]*)$")
        for value in node.values():
            fill_model_bounds(value, vocab_size, max_model_len)
