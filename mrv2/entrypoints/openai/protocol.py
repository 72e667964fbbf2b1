"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields), and their
SamplingParams.

Unknown fields are logged as ignored and otherwise dropped, as vLLM does (OpenAI's own API
refuses them). Every OpenAI field a standard client
sends is declared; those whose meaning this server does not implement (the deprecated
functions / function_call, suffix, best_of > n) are refused by name rather than ignored. Numbers are
bounded so that nothing a client sends can overflow when it crosses to the engine core, and
NaN / infinity are refused.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, WithJsonSchema

from mrv2.entrypoints.openai.errors import BadRequest
from mrv2.entrypoints.openai.protocol_base import OpenAIBaseModel
from mrv2.entrypoints.openai.openapi_rules import (
    BUDGET, CHAT_RULES, INT64_MAX, NON_EMPTY_PROMPT_SCHEMA, TOKENIZE_RULES, JsonFloat, JsonInt,
    LogitBias, OnlyNull, RESPONSE_FORMAT_RULES,
    SAMPLING_RULES, StopStrings, TokenId, sampling_range)
from mrv2.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

# Samples per prompt: each is a request in the engine, so a huge n is refused, not queued.
MAX_N = 128

Int64 = Annotated[JsonInt, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]


class JsonSchemaFormat(OpenAIBaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's response_format; "structural_tag" is vLLM's (xgrammar's `format`, or the
    older `structures` + `triggers`)."""

    model_config = ConfigDict(json_schema_extra=RESPONSE_FORMAT_RULES)

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` request field (SamplingParams.structured_outputs): exactly
    one constraint."""

    json_: str | dict[str, Any] | None = Field(None, alias="json", description="JSON schema")
    regex: str | None = Field(None, description="regular expression")
    choice: list[str] | None = Field(None, description="one of these strings",
                                     json_schema_extra={"minItems": 1})
    grammar: str | None = Field(None, description="GBNF/EBNF (::= rules) or Lark grammar")
    json_object: StrictBool | None = Field(None, description="any JSON object")
    structural_tag: str | None = Field(None, description="xgrammar structural tag (JSON)")
    disable_any_whitespace: StrictBool = Field(False, description="no free whitespace in JSON")
    disable_additional_properties: StrictBool = Field(
        False, description="objects take only the properties their schema lists")
    disable_fallback: StrictBool = False
    whitespace_pattern: Annotated[str | None, OnlyNull] = Field(
        None, description="not supported (xgrammar)")


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ChatCompletionTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class SamplingRequest(OpenAIBaseModel):
    """Fields completions and chat share."""
    model_config = ConfigDict(json_schema_extra=SAMPLING_RULES)
    model: str | None = None
    frequency_penalty: JsonFloat | None = sampling_range("frequency_penalty")
    presence_penalty: JsonFloat | None = sampling_range("presence_penalty")
    logit_bias: LogitBias | None = None
    n: JsonInt = Field(1, ge=1, le=MAX_N)
    seed: Int64 | None = None
    stop: StopStrings = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: JsonFloat | None = sampling_range("temperature")
    top_p: JsonFloat | None = sampling_range("top_p")
    user: str | None = None
    # vLLM's extra parameters (the client's `extra_body`).
    top_k: Int64 | None = None
    min_p: JsonFloat | None = sampling_range("min_p")
    repetition_penalty: JsonFloat | None = sampling_range("repetition_penalty")
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool = False
    min_tokens: Int64 = 0
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    allowed_token_ids: list[TokenId] | None = None
    # Constrained output (openai/structured_outputs.py): OpenAI's response_format, vLLM's
    # structured_outputs, and vLLM's older guided_* spelling of the same.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, json_schema_extra={"minItems": 1})
    guided_grammar: str | None = None
    # Other backends are refused by name; the schema shows the one served.
    guided_decoding_backend: Annotated[str | None, WithJsonSchema(
        {"anyOf": [{"enum": ["auto", "xgrammar"]}, {"type": "null"}]})] = None
    guided_whitespace_pattern: Annotated[str | None, OnlyNull] = None

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options can only be set when stream is true",
                             param="stream_options")

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """Usage on every chunk too (vLLM's `continuous_usage_stats`; only with
        include_usage, as in vLLM)."""
        return self.include_usage() and self.stream_options.continuous_usage_stats

    def requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    def sampling_params(self, max_tokens: int | None, *, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        defaults: dict[str, Any] | None = None,
                        structured_outputs: StructuredOutputsParams | None = None
                        ) -> SamplingParams:
        """SamplingParams for this request with `max_tokens` (the caller's, once it knows the
        prompt's length). Raises ValueError on a bad value."""
        defaults = defaults or {}

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value

        return SamplingParams(
            n=self.n, presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0), min_p=pick("min_p", 0.0), seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, max_tokens=max_tokens,
            min_tokens=self.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=_logit_bias(self.logit_bias), allowed_token_ids=self.allowed_token_ids,
            structured_outputs=structured_outputs)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} with string keys; biases are clamped to [-100, 100]."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias keys must be token ids, got {key!r}",
                             param="logit_bias") from None
        if not 0 <= token <= INT64_MAX:
            raise BadRequest(f"logit_bias key {key!r} is not a valid token id",
                             param="logit_bias")
        out[token] = min(max(value, -100.0), 100.0)
    return out


Prompt = Annotated[str | list[str] | list[TokenId] | list[list[TokenId]],
                   WithJsonSchema(NON_EMPTY_PROMPT_SCHEMA)]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    # 0 only with echo: score the prompt (lm-eval's loglikelihood requests), generate nothing.
    max_tokens: JsonInt | None = Field(16, ge=0, le=INT64_MAX, json_schema_extra=BUDGET)
    echo: StrictBool = False
    logprobs: JsonInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Annotated[JsonInt | None, WithJsonSchema(
        {"type": "null", "description": "accepted only equal to n"})] = Field(None, ge=1,
                                                                            le=MAX_N)
    suffix: Annotated[str | None, OnlyNull] = None
    # vLLM's extra parameters.
    prompt_logprobs: JsonInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: StrictBool = True
    truncate_prompt_tokens: JsonInt | None = Field(None, ge=1, le=INT64_MAX)

    def check(self) -> None:
        self.check_stream_options()
        if self.suffix:
            raise BadRequest("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest(f"best_of={self.best_of} is not supported: only best_of == n",
                             param="best_of")
        if self.stream and self.prompt_logprobs is not None:
            raise BadRequest("prompt_logprobs is not supported when streaming",
                             param="prompt_logprobs")
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest("max_tokens must be at least 1 (0 only with echo, to score the "
                             "prompt)", param="max_tokens")

    @property
    def echo_only(self) -> bool:
        """max_tokens=0 with echo: the answer is the prompt (and its logprobs) alone."""
        return self.echo and self.max_tokens == 0

    def requested_max_tokens(self) -> int | None:
        # An echo-only request still runs one step: the prefill that computes the prompt's
        # logprobs samples a token, which the response drops (vLLM does the same).
        return 1 if self.echo_only else self.max_tokens

    def to_sampling_params(self, max_tokens: int | None = None,
                           defaults: dict[str, Any] | None = None,
                           structured_outputs: StructuredOutputsParams | None = None
                           ) -> SamplingParams:
        # Echo with logprobs needs the prompt's logprobs too (they are part of the answer).
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = self.logprobs
        return self.sampling_params(max_tokens, logprobs=self.logprobs,
                                    prompt_logprobs=prompt_logprobs, defaults=defaults,
                                    structured_outputs=structured_outputs)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra={"required": ["type", "text"]})
    # Other kinds (images, audio) are refused by name (to_template_dict); the schema shows
    # the one served.
    type: Annotated[str, WithJsonSchema({"const": "text"})]
    text: Annotated[str | None, WithJsonSchema({"type": "string"})] = None


class ChatMessage(BaseModel):
    # Clients send fields of their own in messages (name, tool_calls, refusal, ...): they are
    # handed to the chat template, as vLLM does.
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None

    def to_template_dict(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise BadRequest(f"message content of type {part.type!r} is not supported: "
                                     f"only text", param="messages")
                texts.append(part.text)
            message["content"] = "\n".join(texts)
        elif content is None:
            message["content"] = ""
        # Chat templates index into a call's arguments (Qwen's, Llama's): OpenAI sends them as
        # a JSON string, so they are parsed back into an object, as vLLM does.
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass  # not JSON: the template gets the text
        return message


class ChatCompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra=CHAT_RULES)

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: JsonInt | None = Field(None, ge=1, le=INT64_MAX, json_schema_extra=BUDGET)
    max_completion_tokens: JsonInt | None = Field(None, ge=1, le=INT64_MAX,
                                              json_schema_extra=BUDGET)
    logprobs: StrictBool | None = False
    top_logprobs: JsonInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    functions: Annotated[list[dict[str, Any]] | None, OnlyNull] = None
    function_call: Annotated[str | dict[str, Any] | None, WithJsonSchema(
        {"anyOf": [{"enum": ["none", "auto"]}, {"type": "null"}]})] = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    # vLLM's extra parameters.
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    # None: add the BOS only when the rendered template does not start with it.
    add_special_tokens: StrictBool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        self.check_stream_options()
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs to be true", param="top_logprobs")
        if self.functions or self.function_call not in (None, "none", "auto"):
            raise BadRequest("functions / function_call (deprecated by OpenAI) are not "
                             "supported: use tools and tool_choice", param="functions")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise BadRequest("tool_choice needs tools", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools}:
                raise BadRequest(f"tool_choice names the function {name!r}, which is not in "
                                 f"tools", param="tool_choice")
        if self.add_generation_prompt and self.continue_final_message:
            raise BadRequest("add_generation_prompt and continue_final_message cannot both be "
                             "true", param="continue_final_message")

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when tools are given, "none" otherwise."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def to_sampling_params(self, max_tokens: int | None = None,
                           defaults: dict[str, Any] | None = None,
                           structured_outputs: StructuredOutputsParams | None = None
                           ) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs=logprobs, defaults=defaults,
                                    structured_outputs=structured_outputs)


class TokenizeRequest(OpenAIBaseModel):
    model_config = ConfigDict(json_schema_extra=TOKENIZE_RULES)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionTool] | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId]

