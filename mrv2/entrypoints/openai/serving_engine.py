"""What the completion and chat endpoints share: the model check, the context-length check,
running engine requests with metrics, server-sent events, and aborting on disconnect.

Requests run with DELTA outputs, streamed or not, so that time to first token is measured
for every request. A request whose HTTP client goes away is aborted in the engine: a streaming
one when Starlette stops iterating its body (the generators' cleanup aborts), a non-streaming
one by `run_until_disconnected`, which cancels the handler once the client hangs up.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import Request

from mrv2.engine.async_llm import AsyncLLM
from mrv2.entrypoints.openai.cli_args import ServerConfig
from mrv2.entrypoints.openai.errors import BadRequest, OpenAIError, to_openai_error
from mrv2.entrypoints.openai.metrics import ServerMetrics
from mrv2.outputs import RequestOutput, RequestOutputKind
from mrv2.sampling_params import SamplingParams

T = TypeVar("T")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, config: ServerConfig, metrics: ServerMetrics,
                 default_sampling: dict[str, Any]) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.default_sampling = default_sampling
        self.max_model_len = engine.config.model_config.max_model_len

    @property
    def tokenizer(self):
        return self.engine.get_tokenizer()

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.config.served_model_names:
            raise OpenAIError(f"The model `{name}` does not exist.", 404, param="model",
                              code="model_not_found")

    def check_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise BadRequest(f"{what} needs a tokenizer, and this model has none")

    def max_tokens_for(self, num_prompt_tokens: int, requested: int | None,
                       param: str = "max_tokens") -> int:
        """max_tokens for a prompt of this length; 400 naming the numbers when the prompt
        (plus the requested tokens) does not fit in the context. Unset: the rest of the
        context. The generation config's max_new_tokens caps either (vLLM's rule)."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {num_prompt_tokens} input tokens, which leaves no room for output. "
                f"Please reduce the length of the input.", param="prompt",
                code="context_length_exceeded")
        room = limit - num_prompt_tokens
        cap = self.default_sampling.get("max_tokens")
        if requested is None:
            return room if cap is None else max(1, min(room, int(cap)))
        if requested > room:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the input, "
                f"{requested} in the completion). Please reduce the length of the input or "
                f"completion.", param=param, code="context_length_exceeded")
        return requested if cap is None else max(1, min(requested, int(cap)))

    async def generate(self, prompt: dict[str, Any], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """The engine's DELTA outputs for one prompt, with metrics. Closing this generator
        early (client gone, error) aborts the request in the engine."""
        timer = self.metrics.request_timer(len(prompt["prompt_token_ids"]))
        finished = False
        try:
            async with aclosing(self.engine.generate(prompt, params, request_id,
                                                     RequestOutputKind.DELTA)) as outputs:
                async for output in outputs:
                    timer.on_tokens(sum(len(c.token_ids) for c in output.outputs))
                    for completion in output.outputs:
                        if completion.finish_reason is not None:
                            timer.on_completion_finished(completion.finish_reason)
                        if completion.finish_reason == "error":
                            # As vLLM: the engine failed this request alone (e.g. NaN logits).
                            raise OpenAIError("Internal server error: the engine could not "
                                              "complete this request", 500)
                    finished = output.finished
                    yield output
        finally:
            timer.on_request_finished(aborted=not finished)


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(stream index, item) from several async iterators as items arrive. Leaving early
    cancels the rest (their cleanup aborts their requests)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    await queue.put((index, item))
        except BaseException as error:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, error))
            return
        await queue.put((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def run_until_disconnected(raw_request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the HTTP client disconnects first (the body must have
    been read already)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled (server shutdown)
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    # The client left first. A cancelled task is only "cancelled" once it has run its
    # cleanup (the engine abort), so wait for that before answering.
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    raise OpenAIError("Client disconnected", 499)


async def event_stream(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Server-sent events: an error mid-stream becomes an error event, then [DONE]."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk
    except Exception as error:  # noqa: BLE001 - the status line was sent already
        yield sse(to_openai_error(error).body())
    yield SSE_DONE


def now() -> int:
    return int(time.time())

