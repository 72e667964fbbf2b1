"""The OpenAI Responses API (`POST /v1/responses`): its request body, and the shapes it answers
(the response object, its output items and the stream's events).

A request runs through the chat route's machinery: its input items become chat messages
(serving_responses.py) and `to_chat_request` the ChatCompletionRequest that samples them.
What this server does not implement (built-in tools, background mode, conversations, prompt
templates, non-text input, logprobs via `include`) is refused by name in `check`; unknown
fields are logged as ignored, as on every route.

The response-side models document /openapi.json only: the handler builds dicts, as the other
routes do (answer_schemas.py), and the tests validate what the server sends against them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictBool, Tag, TypeAdapter,
                      ValidationError, WithJsonSchema, field_validator)
from pydantic.json_schema import SkipJsonSchema

from mrv2.entrypoints.openai.errors import BadRequest
from mrv2.entrypoints.openai.openapi_rules import (CONTEXT_MARK, FORMAT_RULES, RESPONSES_RULES,
                                                   JsonFloat, JsonInt, OnlyNull, sampling_range)
from mrv2.entrypoints.openai.protocol import (INT64_MAX, ChatCompletionRequest, LogitBias,
                                              OpenAIBaseModel)

ItemStatus = Literal["in_progress", "completed", "incomplete"]


# -- the request ---------------------------------------------------------------------------

# The content parts served: text. Other kinds (images, files) are refused by name.
TEXT_PARTS = ("input_text", "output_text")


class InputContentPart(BaseModel):
    # Extra fields: annotations, logprobs of echoed output text. The schema shows the parts
    # served (a text part with its text).
    model_config = ConfigDict(extra="allow", json_schema_extra={"required": ["type", "text"]})
    type: Annotated[str, WithJsonSchema({"enum": list(TEXT_PARTS)})]
    text: Annotated[str | None, WithJsonSchema({"type": "string"})] = None


class InputMessage(BaseModel):
    # Output items sent back as input carry id and status: kept out of the prompt.
    model_config = ConfigDict(extra="allow")
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputContentPart]


class FunctionCallInput(BaseModel):
    """A call the model made (an earlier response's output item)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputInput(BaseModel):
    """The result of a call, for the model's next turn."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputContentPart]


class OtherInputItem(BaseModel):
    """Any other item: a reasoning item is dropped, anything else refused by name (so the
    schema shows only the kind served)."""

    model_config = ConfigDict(extra="allow")
    type: Annotated[str, WithJsonSchema({"const": "reasoning"})]


def _input_tag(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else \
        getattr(value, "type", "message")
    return kind if kind in ("message", "function_call", "function_call_output") else "other"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallInput, Tag("function_call")]
    | Annotated[FunctionCallOutputInput, Tag("function_call_output")]
    | Annotated[OtherInputItem, Tag("other")], Discriminator(_input_tag)]
_INPUT_ITEMS = {"message": TypeAdapter(InputMessage),
                "function_call": TypeAdapter(FunctionCallInput),
                "function_call_output": TypeAdapter(FunctionCallOutputInput),
                "other": TypeAdapter(OtherInputItem)}


def parse_each(values: Any, field: str, tag: Callable[[Any], str],
               adapters: dict[str, TypeAdapter]) -> Any:
    """A list of items of several kinds, each validated as the kind `tag` says: a bad one is a
    400 naming `field.<index>.<its field>` (a plain union would name every kind it tried)."""
    if not isinstance(values, list):
        return values
    out = []
    for i, value in enumerate(values):
        try:
            out.append(adapters[tag(value)].validate_python(value))
        except ValidationError as error:
            first = error.errors()[0]
            param = ".".join([field, str(i), *(str(p) for p in first["loc"])])
            raise BadRequest(f"{param}: {first['msg']}", param=param) from None
    return out


def parse_input_items(values: list[Any]) -> list[Any]:
    """Input items (or a stored response's output items) as the models above."""
    return parse_each(values, "input", _input_tag, _INPUT_ITEMS)


class FunctionTool(OpenAIBaseModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class OtherTool(BaseModel):
    """A built-in tool (web_search, file_search, mcp, ...): refused, so its schema is `not {}`."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"not": {}})
    type: str


def _tool_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "function" if kind == "function" else "other"


Tool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[OtherTool, Tag("other")],
                 Discriminator(_tool_tag)]
_TOOLS = {"function": TypeAdapter(FunctionTool), "other": TypeAdapter(OtherTool)}


class FunctionToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIBaseModel):
    model_config = ConfigDict(json_schema_extra=FORMAT_RULES)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None


class ResponsesRequest(OpenAIBaseModel):
    model_config = ConfigDict(json_schema_extra=RESPONSES_RULES)

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = Field(None, description="a system message ahead of the input")
    max_output_tokens: JsonInt | None = Field(None, ge=1, le=INT64_MAX,
                                          json_schema_extra={CONTEXT_MARK: True})
    temperature: JsonFloat | None = sampling_range("temperature")
    top_p: JsonFloat | None = sampling_range("top_p")
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    text: TextConfig | None = None
    tools: list[Tool] | None = None
    # Other tool kinds' choices (dicts) are refused by name; the schema shows those served.
    tool_choice: (Literal["none", "auto", "required"] | FunctionToolChoice
                  | SkipJsonSchema[dict[str, Any]] | None) = None
    parallel_tool_calls: StrictBool = True
    store: StrictBool = Field(True, description="kept in this server's memory (bounded) for GET "
                                          "/v1/responses/{id} and previous_response_id")
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    reasoning: dict[str, Any] | None = Field(None, description="echoed; the chat template and "
                                                               "--reasoning-parser decide")
    top_logprobs: JsonInt | None = Field(None, ge=0, le=20)
    # OpenAI's, not implemented here: refused when set (check); the schema shows the values
    # served.
    background: Annotated[StrictBool | None, WithJsonSchema(
        {"anyOf": [{"const": False}, {"type": "null"}]})] = None
    conversation: Annotated[str | dict[str, Any] | None, OnlyNull] = None
    include: Annotated[list[str] | None, WithJsonSchema(
        {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]})] = None
    max_tool_calls: Annotated[JsonInt | None, OnlyNull] = None
    prompt: Annotated[dict[str, Any] | None, OnlyNull] = None
    # "auto" is refused by name; the schema shows what is served.
    truncation: Annotated[Literal["auto", "disabled"] | None, WithJsonSchema(
        {"anyOf": [{"const": "disabled"}, {"type": "null"}]})] = None
    # vLLM's extra parameters (the client's `extra_body`).
    top_k: JsonInt | None = Field(None, ge=-1, le=INT64_MAX)
    logit_bias: LogitBias | None = None
    skip_special_tokens: StrictBool = True

    @field_validator("input", mode="before")
    @classmethod
    def _parse_input(cls, value: Any) -> Any:
        return parse_input_items(value)

    @field_validator("tools", mode="before")
    @classmethod
    def _parse_tools(cls, value: Any) -> Any:
        return parse_each(value, "tools", _tool_tag, _TOOLS)

    def check(self) -> None:
        """400 naming the field for what this server does not implement."""
        if self.background:
            raise BadRequest("background mode is not supported", param="background")
        for name in ("conversation", "prompt", "max_tool_calls"):
            if getattr(self, name) is not None:
                raise BadRequest(f"{name} is not supported", param=name)
        if self.include:
            raise BadRequest(f"include={self.include} is not supported", param="include")
        if self.truncation == "auto":
            raise BadRequest('truncation "auto" is not supported: the input must fit the '
                             'context', param="truncation")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options can only be set when stream is true",
                             param="stream_options")
        for tool in self.tools or ():
            if isinstance(tool, OtherTool):
                raise BadRequest(f"tools of type {tool.type!r} are not supported: only "
                                 f"function tools", param="tools")
        self._check_tool_choice()
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
            raise BadRequest("text.format json_schema needs a schema", param="text.format")

    def _check_tool_choice(self) -> None:
        choice = self.tool_choice
        if isinstance(choice, dict):
            raise BadRequest(f"tool_choice {choice.get('type')!r} is not supported: none, "
                             f"auto, required or a function", param="tool_choice")
        if choice not in (None, "none", "auto") and not self.tools:
            raise BadRequest("tool_choice needs tools", param="tool_choice")
        if isinstance(choice, FunctionToolChoice) and \
                choice.name not in {t.name for t in self.tools}:
            raise BadRequest(f"tool_choice names the function {choice.name!r}, which is not "
                             f"in tools", param="tool_choice")

    def input_items(self) -> list[Any]:
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return self.input

    def to_chat_request(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request that runs this one: `messages` after the instructions."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        choice = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            choice = {"type": "function", "function": {"name": choice.name}}
        fmt = self.text.format if self.text else None
        response_format = None
        if fmt is not None and fmt.type != "text":
            response_format = {"type": fmt.type, "json_schema": {
                "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict,
            } if fmt.type == "json_schema" else None}
        tools = [{"type": "function", "function": t.model_dump(exclude={"type"})}
                 for t in self.tools or ()]
        return ChatCompletionRequest.model_validate({
            "model": self.model, "messages": system + messages, "tools": tools or None,
            "tool_choice": choice, "parallel_tool_calls": self.parallel_tool_calls,
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "logit_bias": self.logit_bias,
            "skip_special_tokens": self.skip_special_tokens, "user": self.user,
            "response_format": response_format})

    def echo(self) -> dict[str, Any]:
        """The request's fields a response object repeats."""
        choice = self.tool_choice or "auto"
        fmt = self.text.format if self.text and self.text.format else TextFormat(type="text")
        return {
            "instructions": self.instructions, "metadata": self.metadata,
            "parallel_tool_calls": self.parallel_tool_calls,
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump() for t in self.tools or ()],
            "max_output_tokens": self.max_output_tokens, "max_tool_calls": None,
            "previous_response_id": self.previous_response_id, "reasoning": self.reasoning,
            "background": False, "service_tier": "default", "store": self.store,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            "top_logprobs": self.top_logprobs or 0, "truncation": "disabled",
            "user": self.user, "safety_identifier": self.safety_identifier,
            "prompt_cache_key": self.prompt_cache_key}


# -- the response (documentation) ------------------------------------------------------------

class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]]
    logprobs: list[dict[str, Any]]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(BaseModel):
    """With --reasoning-parser: the model's thinking."""

    id: str
    type: Literal["reasoning"]
    summary: list[dict[str, Any]]
    content: list[ReasoningText]
    status: ItemStatus


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"]
    call_id: str = Field(description="what the function_call_output item answers")
    name: str
    arguments: str = Field(description="a JSON text")
    status: ItemStatus


OutputItem = Annotated[OutputMessage | ReasoningItem | FunctionCallItem,
                       Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens found in the prefix cache")
    cache_write_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponsesResponse(BaseModel):
    """The response object: POST /v1/responses, GET /v1/responses/{id}, and the lifecycle
    events of a stream."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    error: None
    incomplete_details: IncompleteDetails | None
    output: list[OutputItem]
    usage: ResponseUsage | None
    temperature: float
    top_p: float
    instructions: str | None
    metadata: dict[str, str] | None
    parallel_tool_calls: bool
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice
    tools: list[FunctionTool]
    max_output_tokens: int | None
    max_tool_calls: None
    previous_response_id: str | None
    reasoning: dict[str, Any] | None
    background: bool
    service_tier: str
    store: bool
    text: TextConfig
    top_logprobs: int
    truncation: Literal["disabled"]
    user: str | None
    safety_identifier: str | None
    prompt_cache_key: str | None
