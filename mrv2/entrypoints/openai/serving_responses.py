"""`POST /v1/responses` and `GET /v1/responses/{id}`: OpenAI's Responses API, run through the
chat route (the request becomes a ChatCompletionRequest: same template, sampling parameters,
structured outputs, tool and reasoning parsers, checks and 400s).

The input items become chat messages (`chat_messages`: a `function_call` item an assistant
message's tool call, a `function_call_output` item a `tool` message; reasoning items are
dropped, as vLLM does). Non-streaming, the output is parsed whole (ChatChoiceParser.message,
as a chat completion's is); streaming, piece by piece (its deltas) into server-sent events
named by their type:
response.created, response.in_progress, then each output item's events (responses_output.py),
then response.completed with the whole response, whatever its status (as vLLM: the openai
client's stream helper waits for it). A failure mid-stream is an `error` event, the last.
Responses with `store` (OpenAI's default: true) are kept in a bounded in-memory store.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request

from mrv2.entrypoints.openai.chat_output import ChatChoiceParser
from mrv2.entrypoints.openai.errors import BadRequest, OpenAIError, to_openai_error
from mrv2.entrypoints.openai.responses_output import (ResponseOutput, new_id,
                                                      reasoning_token_count,
                                                      whole_message_delta)
from mrv2.entrypoints.openai.responses_protocol import (FunctionCallInput,
                                                        FunctionCallOutputInput,
                                                        InputContentPart, InputMessage,
                                                        TEXT_PARTS, ResponsesRequest,
                                                        parse_input_items)
from mrv2.entrypoints.openai.responses_store import ResponseStore
from mrv2.entrypoints.openai.serving_chat import OpenAIServingChat
from mrv2.entrypoints.openai.serving_engine import now, run_until_disconnected, sse
from mrv2.outputs import RequestOutput
from mrv2.sampling_params import SamplingParams

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# The chat request's field names in its 400s -> the Responses request's.
_PARAM_NAMES = {"messages": "input", "prompt": "input", "max_completion_tokens":
                "max_output_tokens", "max_tokens": "max_output_tokens",
                "response_format": "text.format"}


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = ResponseStore() if store is None else store

    def retrieve(self, response_id: str) -> dict[str, Any]:
        entry = self.store.get(response_id)
        if entry is None:
            raise OpenAIError(f"Response with id '{response_id}' not found.", 404,
                              param="response_id")
        return entry.response

    async def create(self, request: ResponsesRequest, raw_request: Request):
        """The response object, or (streaming) an async iterator of SSE strings."""
        request.check()
        conversation: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id)
            if previous is None:
                raise OpenAIError(f"Previous response with id '{request.previous_response_id}'"
                                  f" not found.", 404, param="previous_response_id")
            conversation = list(previous.conversation)
        conversation += chat_messages(request.input_items())
        if not conversation and not request.instructions:
            raise BadRequest("input holds no message", param="input")
        chat_request = request.to_chat_request(conversation)
        try:
            prompt, params = self.chat.prepare(chat_request)
        except OpenAIError as error:
            raise _renamed(error) from None
        run = _Run(self, request, conversation, params, len(prompt["prompt_token_ids"]),
                   self.chat.choice_parser(chat_request))
        outputs = self.chat.generate(prompt, params, run.id)
        if request.stream:
            return self._stream(run, outputs)
        return await run_until_disconnected(raw_request, self._full(run, outputs))

    async def _full(self, run: _Run, outputs: AsyncIterator[RequestOutput]) -> dict[str, Any]:
        text = ""
        async with aclosing(outputs):
            async for output in outputs:
                run.add(output)
                text += output.outputs[0].text
        message, _ = run.parser.message(text)
        run.output.feed(whole_message_delta(message))
        run.output.close(run.status)
        return run.finish()

    async def _stream(self, run: _Run, outputs: AsyncIterator[RequestOutput]
                      ) -> AsyncIterator[str]:
        numbers = itertools.count()

        def event(fields: dict[str, Any]) -> str:
            return f"event: {fields['type']}\n" + sse({**fields,
                                                      "sequence_number": next(numbers)})

        for kind in ("response.created", "response.in_progress"):
            yield event({"type": kind, "response": run.response("in_progress")})
        try:
            async with aclosing(outputs):
                async for output in outputs:
                    for fields in run.step(output):
                        yield event(fields)
        except Exception as error:  # noqa: BLE001 - the status line was sent already
            failure = to_openai_error(error)
            yield event({"type": "error", "code": failure.code, "message": failure.message,
                         "param": failure.param, **failure.body()})
            return
        for fields in run.output.close(run.status):
            yield event(fields)
        yield event({"type": "response.completed", "response": run.finish()})


class _Run:
    """One response being generated: the parsers' state, the output so far, the counts."""

    def __init__(self, serving: OpenAIServingResponses, request: ResponsesRequest,
                 conversation: list[dict[str, Any]], params: SamplingParams, num_prompt: int,
                 parser: ChatChoiceParser) -> None:
        self.serving, self.request, self.params = serving, request, params
        self.conversation = conversation
        self.num_prompt = num_prompt
        self.parser = parser
        self.id = new_id("resp")
        self.created_at = now()
        self.output = ResponseOutput()
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.num_cached = 0

    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def add(self, output: RequestOutput) -> None:
        completion = output.outputs[0]
        self.token_ids += completion.token_ids
        self.finish_reason = completion.finish_reason or self.finish_reason
        self.num_cached = output.num_cached_tokens

    def step(self, output: RequestOutput) -> list[dict[str, Any]]:
        """The stream events one engine output adds."""
        self.add(output)
        completion = output.outputs[0]
        events = self.output.feed(self.parser.delta(completion.text)) if completion.text \
            else []
        if completion.finish_reason is not None:
            events += self.output.feed(self.parser.finish())
        return events

    def response(self, status: str) -> dict[str, Any]:
        done = status != "in_progress"
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "model": self.serving.chat.config.model_name, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"}
                if status == "incomplete" else None,
                "output": self.output.items if done else [],
                "usage": self._usage() if done else None,
                "temperature": self.params.temperature, "top_p": self.params.top_p,
                **self.request.echo()}

    def finish(self) -> dict[str, Any]:
        """The final response object (the output closed), stored when the request says so."""
        response = self.response(self.status)
        if self.request.store:
            output = chat_messages(parse_input_items(response["output"]))
            self.serving.store.put(response, self.conversation + output)
        return response

    def _usage(self) -> dict[str, Any]:
        reasoning = self.parser.reasoning_parser
        tokenizer = self.serving.chat.tokenizer
        count = len(self.token_ids)
        reasoning_tokens = reasoning_token_count(
            self.output.items, self.token_ids,
            reasoning.end_token_id if reasoning is not None else None,
            lambda text: len(tokenizer(text, add_special_tokens=False).input_ids))
        return {"input_tokens": self.num_prompt,
                "input_tokens_details": {"cached_tokens": self.num_cached,
                                         "cache_write_tokens": 0},
                "output_tokens": count,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": self.num_prompt + count}


def chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items (or output items sent back) -> chat messages; a call joins the assistant
    message before it, as one assistant turn."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if isinstance(item, InputMessage):
            messages.append({"role": ROLES[item.role],
                             "content": _text(item.content, f"input[{i}].content")})
        elif isinstance(item, FunctionCallInput):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputInput):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, f"input[{i}].output")})
        elif item.type != "reasoning":
            raise BadRequest(f"input[{i}]: items of type {item.type!r} are not supported: "
                             f"messages, function_call, function_call_output and reasoning",
                             param="input")
    return messages


def _text(content: str | list[InputContentPart], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type not in TEXT_PARTS or part.text is None:
            raise BadRequest(f"{where}: content of type {part.type!r} is not supported: only "
                             f"text", param="input")
        texts.append(part.text)
    return "\n".join(texts)


def _renamed(error: OpenAIError) -> OpenAIError:
    """A 400 from the chat machinery, naming the Responses request's field."""
    name = _PARAM_NAMES.get(error.param or "")
    if name is not None:
        if error.message.startswith(error.param):
            error.message = name + error.message[len(error.param):]
        error.param = name
    return error
