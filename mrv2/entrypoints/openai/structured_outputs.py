"""A request's output constraint, from whichever field the client used: OpenAI's
`response_format`, vLLM's `structured_outputs` or older `guided_*` fields, or (chat) a
`tool_choice` of "required" or a named function, which is enforced by a JSON schema.

At most one source may be given; the constraint is validated here, so a bad schema, regex or
grammar is a 400 naming the request field before anything is queued.
"""

from __future__ import annotations

import json
from typing import Any

from mrv2.config import StructuredOutputsConfig
from mrv2.core.grammar import GrammarError, validate_structured_outputs
from mrv2.entrypoints.openai.errors import BadRequest
from mrv2.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionTool,
                                              NamedToolChoice, ResponseFormat, SamplingRequest)
from mrv2.sampling_params import StructuredOutputsParams

BACKENDS = (None, "auto", "xgrammar")
ANY_OBJECT = {"type": "object"}


def request_structured_outputs(request: SamplingRequest, config: StructuredOutputsConfig
                               ) -> StructuredOutputsParams | None:
    """The request's constraint (None: free text); 400 naming the field on a bad one."""
    sources: list[tuple[str, dict[str, Any]]] = []
    if request.structured_outputs is not None:
        fields = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        if fields.pop("whitespace_pattern", None) is not None:
            raise BadRequest("structured_outputs.whitespace_pattern is not supported by the "
                             "xgrammar backend; use disable_any_whitespace",
                             param="structured_outputs")
        sources.append(("structured_outputs", fields))
    if request.guided_decoding_backend not in BACKENDS:
        raise BadRequest(f"guided_decoding_backend={request.guided_decoding_backend!r}: mrv2 "
                         f"implements 'xgrammar'", param="guided_decoding_backend")
    if request.guided_whitespace_pattern is not None:
        raise BadRequest("guided_whitespace_pattern is not supported by the xgrammar backend",
                         param="guided_whitespace_pattern")
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(request, name)
        if value is not None:
            sources.append((name, {key: value}))
    if request.response_format is not None and request.response_format.type != "text":
        sources.append(("response_format", _from_response_format(request.response_format)))
    if isinstance(request, ChatCompletionRequest):
        tool_schema = tool_choice_schema(request)
        if tool_schema is not None:
            sources.append(("tool_choice", {"json": tool_schema}))
    if not sources:
        return None
    if len(sources) > 1:
        raise BadRequest(f"give one output constraint, not {len(sources)}: "
                         f"{', '.join(name for name, _ in sources)}", param=sources[1][0])
    name, fields = sources[0]
    try:
        params = StructuredOutputsParams(**fields)
        validate_structured_outputs(params, config)
    except (GrammarError, ValueError, TypeError) as error:
        raise BadRequest(f"{name}: {error}", param=name) from None
    return params


def _from_response_format(response_format: ResponseFormat) -> dict[str, Any]:
    if response_format.type == "json_object":
        return {"json_object": True}
    if response_format.type == "json_schema":
        spec = response_format.json_schema
        if spec is None or spec.schema_ is None:
            raise BadRequest("response_format json_schema needs json_schema.schema",
                             param="response_format")
        return {"json": spec.schema_}
    # structural_tag: xgrammar's own format, or vLLM's older structures + triggers.
    if response_format.format is not None:
        return {"structural_tag": json.dumps({"type": "structural_tag",
                                              "format": response_format.format})}
    if not response_format.structures or response_format.triggers is None:
        raise BadRequest("response_format structural_tag needs format, or structures and "
                         "triggers", param="response_format")
    tags = [{"begin": s.get("begin"), "end": s.get("end"),
             "content": {"type": "json_schema", "json_schema": s.get("schema", ANY_OBJECT)}}
            for s in response_format.structures]
    return {"structural_tag": json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": response_format.triggers, "tags": tags}})}


def tool_choice_schema(request: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema that enforces tool_choice "required" (an array of calls, as vLLM) or a
    named function (that function's arguments); None for "none" and "auto"."""
    choice = request.effective_tool_choice
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in request.tools if t.function.name == choice.function.name)
        return tool.function.parameters or ANY_OBJECT
    if choice != "required":
        return None
    calls = {"type": "array", "minItems": 1,
             "items": {"anyOf": [_call_schema(t) for t in request.tools]}}
    if not request.parallel_tool_calls:
        calls["maxItems"] = 1
    return calls


def _call_schema(tool: ChatCompletionTool) -> dict[str, Any]:
    return {"type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                           "parameters": tool.function.parameters or ANY_OBJECT},
            "required": ["name", "parameters"]}
