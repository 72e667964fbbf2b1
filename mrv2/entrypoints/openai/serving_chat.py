"""`POST /v1/chat/completions`: the conversation rendered with the chat template (the
request's, `--chat-template`, or the tokenizer's), then one engine request with n samples."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from mrv2.entrypoints.chat_utils import render_chat
from mrv2.entrypoints.openai.chat_output import ChatChoiceParser
from mrv2.entrypoints.openai.errors import BadRequest
from mrv2.entrypoints.openai.logprobs_format import chat_logprobs
from mrv2.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionTool,
                                              ChatMessage)
from mrv2.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from mrv2.entrypoints.openai.serving_engine import (OpenAIServing, event_stream, merge_streams,
                                                    now, random_id, run_until_disconnected,
                                                    sse, usage)
from mrv2.entrypoints.openai.structured_outputs import request_structured_outputs
from mrv2.entrypoints.openai.tool_parsers import get_tool_parser
from mrv2.sampling_params import SamplingParams

ROLE = "assistant"


class OpenAIServingChat(OpenAIServing):
    def render(self, messages: list[ChatMessage], *, chat_template: str | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               chat_template_kwargs: dict[str, Any] | None = None,
               add_special_tokens: bool | None = None) -> dict[str, Any]:
        """{"prompt", "prompt_token_ids"}; a template that fails on these messages is a 400."""
        self.check_tokenizer("chat")
        conversation = [m.to_template_dict() for m in messages]
        try:
            return render_chat(self.tokenizer, conversation,
                               chat_template or self.config.chat_template, add_generation_prompt,
                               continue_final_message, chat_template_kwargs, add_special_tokens)
        except Exception as error:  # noqa: BLE001 - jinja raises many types on bad input
            raise BadRequest(f"the chat template could not be applied: {error}",
                             param="messages") from None

    def prepare(self, request: ChatCompletionRequest) -> tuple[dict[str, Any], SamplingParams]:
        """The request checked and rendered: (engine prompt, SamplingParams); 400 naming the
        field on bad input. The Responses route runs its requests through this too."""
        self.check_model(request.model)
        request.check()
        if (request.tools and request.effective_tool_choice == "auto"
                and self.config.tool_call_parser is None):
            raise BadRequest('"auto" tool choice requires --enable-auto-tool-choice and '
                             '--tool-call-parser to be set', param="tool_choice")
        prompt = self.render(request.messages, chat_template=request.chat_template,
                             add_generation_prompt=request.add_generation_prompt,
                             continue_final_message=request.continue_final_message,
                             chat_template_kwargs=with_tools(request.chat_template_kwargs,
                                                             request.tools),
                             add_special_tokens=request.add_special_tokens)
        param = "max_completion_tokens" if request.max_completion_tokens is not None \
            else "max_tokens"
        max_tokens = self.max_tokens_for(len(prompt["prompt_token_ids"]),
                                         request.requested_max_tokens(), param)
        structured = request_structured_outputs(
            request, self.engine.config.structured_outputs_config)
        params = request.to_sampling_params(max_tokens, self.default_sampling, structured)
        self.engine.input_processor.process("validate", prompt, params)
        return prompt, params

    async def create(self, request: ChatCompletionRequest, raw_request: Request):
        """A response dict, or (streaming) an async iterator of SSE strings."""
        prompt, params = self.prepare(request)
        request_id = random_id("chatcmpl")
        stream = self.generate(prompt, params, request_id)
        # Usage counts the prompt once, whatever n is (OpenAI's and vLLM's count).
        num_prompt = len(prompt["prompt_token_ids"])
        if request.stream:
            return event_stream(self._stream(request, request_id, stream, num_prompt))
        return await run_until_disconnected(
            raw_request, self._full(request, request_id, stream, num_prompt))

    def _logprobs(self, request: ChatCompletionRequest, token_ids: list[int],
                  logprobs: list | None) -> dict | None:
        if not request.logprobs:
            return None
        return chat_logprobs(token_ids, logprobs or [], self.tokenizer, request.top_logprobs or 0)

    def choice_parser(self, request: ChatCompletionRequest) -> ChatChoiceParser:
        reasoning = tools = None
        if self.config.reasoning_parser:
            reasoning = get_reasoning_parser(self.config.reasoning_parser)(
                self.tokenizer, request.chat_template_kwargs)
        if self.config.tool_call_parser and request.tools:
            tools = get_tool_parser(self.config.tool_call_parser)(self.tokenizer)
        return ChatChoiceParser(request, reasoning, tools)

    async def _full(self, request: ChatCompletionRequest, request_id: str, stream,
                    num_prompt: int) -> dict[str, Any]:
        n = request.n
        texts, token_ids = [""] * n, [[] for _ in range(n)]
        logprobs: list[list] = [[] for _ in range(n)]
        finish: list[tuple[str | None, Any]] = [(None, None)] * n
        async for _, output in merge_streams([stream]):
            for c in output.outputs:
                texts[c.index] += c.text
                token_ids[c.index].extend(c.token_ids)
                logprobs[c.index].extend(c.logprobs or [])
                finish[c.index] = (c.finish_reason, c.stop_reason)
        choices = []
        for i in range(n):
            parser = self.choice_parser(request)
            message, called = parser.message(texts[i])
            choices.append({"index": i, "message": {"role": ROLE, **message},
                            "logprobs": self._logprobs(request, token_ids[i], logprobs[i]),
                            "finish_reason": _finish_reason(parser, called, finish[i][0]),
                            "stop_reason": finish[i][1]})
        return {"id": request_id, "object": "chat.completion", "created": now(),
                "model": self.config.model_name, "choices": choices,
                "usage": usage(num_prompt, sum(len(t) for t in token_ids))}

    async def _stream(self, request: ChatCompletionRequest, request_id: str, stream,
                      num_prompt: int) -> AsyncIterator[str]:
        created, model = now(), self.config.model_name

        continuous = request.continuous_usage()
        generated = [0] * request.n  # tokens so far per choice

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            return sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                        "model": model, "choices": choices, **extra})

        def chunk_usage(index: int) -> dict[str, Any]:
            # continuous_usage_stats: the prompt and this choice's tokens so far (vLLM's).
            return {"usage": usage(num_prompt, generated[index])} if continuous else {}

        # The first chunk of every choice carries the role (OpenAI's and vLLM's order).
        for i in range(request.n):
            yield chunk([{"index": i, "delta": {"role": ROLE, "content": ""}, "logprobs": None,
                          "finish_reason": None}], **chunk_usage(i))
        parsers = [self.choice_parser(request) for _ in range(request.n)]
        called = [False] * request.n
        async for _, output in merge_streams([stream]):
            for c in output.outputs:
                generated[c.index] += len(c.token_ids)
                if not (c.text or c.token_ids or c.finish_reason):
                    continue
                parser = parsers[c.index]
                delta = parser.delta(c.text) or {}
                if c.finish_reason is not None:
                    delta = _merge_deltas(delta, parser.finish() or {})
                called[c.index] = called[c.index] or bool(delta.get("tool_calls"))
                if not delta and c.finish_reason is None and not request.logprobs:
                    continue  # held back by a parser (a possible marker)
                yield chunk([{"index": c.index, "delta": delta,
                              "logprobs": self._logprobs(request, c.token_ids, c.logprobs),
                              "finish_reason": _finish_reason(parser, called[c.index],
                                                              c.finish_reason),
                              "stop_reason": c.stop_reason}],
                            **chunk_usage(c.index))
        if request.include_usage():
            yield chunk([], usage=usage(num_prompt, sum(generated)))


def with_tools(template_kwargs: dict[str, Any] | None,
               tools: list[ChatCompletionTool] | None) -> dict[str, Any] | None:
    """The chat template's kwargs with the request's tools (as OpenAI dicts) added."""
    if not tools:
        return template_kwargs
    return {"tools": [t.model_dump(exclude_none=True) for t in tools],
            **(template_kwargs or {})}


def _finish_reason(parser: ChatChoiceParser, called: bool, reason: str | None) -> str | None:
    """vLLM's: "tool_calls" when an auto or required choice called tools and stopped."""
    if called and reason == "stop" and parser.named is None:
        return "tool_calls"
    return reason


def _merge_deltas(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    out = dict(first)
    for key, value in second.items():
        out[key] = out[key] + value if key in out else value
    return out
