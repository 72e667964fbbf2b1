"""What the server answers, as pydantic models: they document /openapi.json only.

The handlers build their answers as dicts (and SSE lines); these models mirror those shapes so
that schema-driven tools and client generators see them. They are used in routes'
`responses=` (never `response_model=`), so nothing on the wire depends on them.
`install_openapi` completes what FastAPI generates: the request bodies (the handlers parse the
raw body themselves, to keep OpenAI's 400 envelope), the streaming chunks, and OpenAI's error
envelope in place of FastAPI's 422.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from mrv2.entrypoints.openai.openapi_rules import NO_AUTO_TOOL_CHOICE, fill_model_bounds
from mrv2.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                              DetokenizeRequest, TokenizeRequest)
from mrv2.entrypoints.openai.tool_parsers.base import DeltaToolCall, ToolCall

REF_PREFIX = "#/components/schemas/"


class ErrorInfo(BaseModel):
    message: str
    type: str = Field(description="e.g. invalid_request_error, service_unavailable_error")
    param: str | None = Field(description="the request field at fault, when there is one")
    code: str | None = Field(description="e.g. model_not_found, context_length_exceeded")


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: every error status (and an error mid-stream) carries it."""

    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoiceLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = Field(
        description="the stop string or token id that ended the choice (vLLM's)")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    """One `data:` event of a streamed completion; the usage-only last one has no choices."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = Field(None, description="with stream_options.include_usage")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning: str | None = Field(description="with --reasoning-parser")
    tool_calls: list[ToolCall]


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    """One `data:` event of a streamed chat completion (the first per choice has the role)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = Field(None, description="with stream_options.include_usage")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(description="with return_token_strs")


class DetokenizeResponse(BaseModel):
    prompt: str


class LoadResponse(BaseModel):
    server_load: int = Field(description="requests in flight (--enable-server-load-tracking)")


class VersionResponse(BaseModel):
    version: str


class ServerInfoResponse(BaseModel):
    vllm_config: str | dict[str, Any]
    versions: dict[str, str]


class ResetPrefixCacheResponse(BaseModel):
    reset: bool


class IsSleepingResponse(BaseModel):
    is_sleeping: bool


_ERROR_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, a bad field or value, a prompt over the context",
    401: "Missing or wrong API key (only with --api-key)",
    404: "The model (or the stored response) does not exist",
    500: "Internal server error",
    503: "The engine is not running",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries of these error statuses, each OpenAI's envelope."""
    return {status: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]}
            for status in statuses}


def json_response(model: type[BaseModel], *errors: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a route answering `model` as JSON, or one of `errors`."""
    return {200: {"model": model}, **error_responses(*errors)}


def generation_responses(model: type[BaseModel], chunk: type[BaseModel],
                         description: str | None = None) -> dict[int | str, dict[str, Any]]:
    """The completion routes: JSON, or with "stream": true server-sent `chunk` events
    (`description` says how the stream goes; without one, the OpenAI completions' stream:
    chunks, an ErrorResponse on a failure mid-stream, then `data: [DONE]`)."""
    data = {"type": "string", "contentMediaType": "application/json",
            "contentSchema": {"$ref": REF_PREFIX + chunk.__name__}}
    if description is None:
        data = {"anyOf": [{"const": "[DONE]"}, {**data, "contentSchema": {"anyOf": [
            data["contentSchema"], {"$ref": REF_PREFIX + ErrorResponse.__name__}]}}]}
    # One event's schema only (`itemSchema`): beside it OpenAPI 3.2 (and schemathesis) read a
    # `schema` as the whole stream, an array of events.
    item = {"type": "object", "required": ["data"], "properties": {"data": data},
            "description": description or (
                f"Server-sent events: each `data:` line holds one {chunk.__name__} (or, on a "
                f"failure mid-stream, an ErrorResponse), the last one is `data: [DONE]`")}
    return {200: {"model": model, "description": "The result, or with stream true its events",
                  "content": {"text/event-stream": {"itemSchema": item}}},
            **error_responses(400, 401, 404, 500, 503)}


def empty_response(*errors: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a route whose 200 has an empty body (health, ping, sleep, wake_up)."""
    return {200: {"description": "Success (an empty body)", "content": {
        "text/plain": {"schema": {"type": "string", "maxLength": 0}}}},
        **error_responses(*errors)}


def text_response(media_type: str, description: str) -> dict[int | str, dict[str, Any]]:
    return {200: {"description": description,
                  "content": {media_type: {"schema": {"type": "string"}}}}}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra=` declaring a JSON body of `model` (the handler parses it itself)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": REF_PREFIX + model.__name__}}}}}


# Models the schema refers to that no route's `responses=` brings in: the request bodies
# (validation mode), the streamed chunks and the error envelope (serialization mode).
_EXTRA_SCHEMAS = [(m, "validation") for m in (TokenizeRequest, DetokenizeRequest)] + \
    [(ErrorResponse, "serialization")]
# The generation routes' bodies and streamed chunks (a generate server's schema only).
GENERATION_REQUESTS = (CompletionRequest, ChatCompletionRequest)
GENERATION_CHUNKS = (CompletionStreamResponse, ChatCompletionStreamResponse)


def install_openapi(app: FastAPI, requests: Sequence[type[BaseModel]] = (),
                    chunks: Sequence[type[BaseModel]] = (),
                    vocab_size: int | None = None, max_model_len: int | None = None,
                    auto_tool_choice: bool = True) -> None:
    """Completes app.openapi(): adds _EXTRA_SCHEMAS (and the other routes' `requests` bodies
    and streamed `chunks`) to the components, replaces FastAPI's 422 (which this server
    never sends: its validation errors are 400s) with the 400 envelope, and bounds token ids
    by the served model's `vocab_size` and token budgets by its `max_model_len`; without
    `auto_tool_choice` (no --tool-call-parser) tools need an explicit tool_choice."""
    generate = app.openapi
    models = _EXTRA_SCHEMAS + [(m, "validation") for m in requests] + \
        [(m, "serialization") for m in chunks]

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            _complete(schema, models)
            fill_model_bounds(schema, vocab_size, max_model_len)
            if not auto_tool_choice:
                for name in ("ChatCompletionRequest", "ResponsesRequest"):
                    body = schema["components"]["schemas"].get(name)
                    if body is not None:
                        body.setdefault("allOf", []).append(NO_AUTO_TOOL_CHOICE)
        return app.openapi_schema

    app.openapi = openapi


def _complete(schema: dict[str, Any], models: list[tuple[type[BaseModel], str]]) -> None:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    _, extra = models_json_schema(models, ref_template=REF_PREFIX + "{model}")
    for name, definition in extra.get("$defs", {}).items():
        components.setdefault(name, definition)
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None and "400" not in responses:
                bad = error_responses(400)[400]
                responses["400"] = {"description": bad["description"], "content": {
                    "application/json": {"schema": {"$ref": REF_PREFIX + "ErrorResponse"}}}}
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
