"""`POST /v1/completions`: one engine request per prompt (a string, a list of strings, a token
list or a list of token lists), n samples each; choice index = prompt index * n + sample."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from mrv2.entrypoints.openai.errors import BadRequest
from mrv2.entrypoints.openai.logprobs_format import CompletionLogprobs
from mrv2.entrypoints.openai.protocol import CompletionRequest
from mrv2.entrypoints.openai.serving_engine import (OpenAIServing, event_stream, merge_streams,
                                                    now, random_id, run_until_disconnected,
                                                    sse, usage)
from mrv2.entrypoints.openai.structured_outputs import request_structured_outputs
from mrv2.sampling_params import SamplingParams


@dataclass
class _Choice:
    """One sample's text, token ids and logprobs, gathered from DELTA outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OpenAIServingCompletion(OpenAIServing):
    def _prompts(self, request: CompletionRequest) -> list[dict[str, Any]]:
        prompt = request.prompt
        if isinstance(prompt, str):
            items: list = [prompt]
        elif not prompt:
            raise BadRequest("prompt must not be empty", param="prompt")
        elif isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        prompts = []
        for item in items:
            text = None
            if isinstance(item, str):
                self.check_tokenizer("a text prompt")
                text = item
                ids = list(self.tokenizer(item, add_special_tokens=request.add_special_tokens)
                           .input_ids) if item else []
            else:
                ids = list(item)
            if request.truncate_prompt_tokens is not None and \
                    len(ids) > request.truncate_prompt_tokens:
                ids, text = ids[-request.truncate_prompt_tokens:], None
            if not ids:
                raise BadRequest("the prompt is empty", param="prompt")
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return prompts

    def _prompt_text(self, prompt: dict[str, Any]) -> str:
        if prompt["prompt"] is not None:
            return prompt["prompt"]
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(prompt["prompt_token_ids"])

    async def create(self, request: CompletionRequest, raw_request: Request):
        """A response dict, or (streaming) an async iterator of SSE strings."""
        self.check_model(request.model)
        request.check()
        prompts = self._prompts(request)
        structured = request_structured_outputs(
            request, self.engine.config.structured_outputs_config)
        params = []
        for prompt in prompts:
            max_tokens = self.max_tokens_for(len(prompt["prompt_token_ids"]),
                                             request.requested_max_tokens())
            params.append(request.to_sampling_params(max_tokens, self.default_sampling,
                                                     structured))
            self.engine.input_processor.process("validate", prompt, params[-1])
        request_id = random_id("cmpl")
        streams = [self.generate(prompt, p, f"{request_id}-{i}")
                   for i, (prompt, p) in enumerate(zip(prompts, params))]
        if request.stream:
            return event_stream(self._stream(request, request_id, prompts, params, streams))
        return await run_until_disconnected(
            raw_request, self._full(request, request_id, prompts, params, streams))

    def _logprobs(self, request: CompletionRequest, prompt: dict[str, Any],
                  prompt_logprobs: list | None, choice: _Choice) -> dict | None:
        if request.logprobs is None:
            return None
        builder = CompletionLogprobs(self.tokenizer)
        parts = []
        if request.echo:
            ids = prompt["prompt_token_ids"]
            parts.append(builder.build(ids, prompt_logprobs or [None] * len(ids)))
        parts.append(builder.build(choice.token_ids, choice.logprobs))
        return {key: [v for part in parts for v in part[key]] for key in parts[0]}

    async def _full(self, request: CompletionRequest, request_id: str, prompts: list,
                    params: list[SamplingParams], streams: list) -> dict[str, Any]:
        n = request.n
        choices = [[_Choice() for _ in range(n)] for _ in prompts]
        prompt_logprobs: list[list | None] = [None] * len(prompts)
        async for i, output in merge_streams(streams):
            if output.prompt_logprobs is not None:
                prompt_logprobs[i] = output.prompt_logprobs
            for completion in output.outputs:
                choice = choices[i][completion.index]
                if request.echo_only:  # the sampled token is not part of the answer
                    choice.finish_reason = completion.finish_reason and "length"
                    continue
                choice.text += completion.text
                choice.token_ids.extend(completion.token_ids)
                choice.logprobs.extend(completion.logprobs or [])
                choice.finish_reason = completion.finish_reason
                choice.stop_reason = completion.stop_reason
        out, num_generated = [], 0
        for i, prompt in enumerate(prompts):
            echo = self._prompt_text(prompt) if request.echo else ""
            for index, choice in enumerate(choices[i]):
                num_generated += len(choice.token_ids)
                out.append({"index": i * n + index, "text": echo + choice.text,
                            "logprobs": self._logprobs(request, prompt, prompt_logprobs[i],
                                                       choice),
                            "finish_reason": choice.finish_reason,
                            "stop_reason": choice.stop_reason})
        return {"id": request_id, "object": "text_completion", "created": now(),
                "model": self.config.model_name, "choices": out,
                "usage": usage(_num_prompt_tokens(prompts), num_generated)}

    async def _stream(self, request: CompletionRequest, request_id: str, prompts: list,
                      params: list[SamplingParams], streams: list) -> AsyncIterator[str]:
        n, created, model = request.n, now(), self.config.model_name
        # Tokens generated so far per (prompt, sample); a key is present once its first
        # chunk (which carries the echo) was built.
        generated: dict[tuple[int, int], int] = {}
        builders: dict[tuple[int, int], CompletionLogprobs] = {}
        async for i, output in merge_streams(streams):
            for completion in output.outputs:
                if request.echo_only:  # the sampled token is not part of the answer
                    completion = _EchoOnly(completion.index, completion.finish_reason and "length")
                key = (i, completion.index)
                prefix, prompt_part = "", None
                if key not in generated:
                    generated[key] = 0
                    if request.echo:
                        prefix = self._prompt_text(prompts[i])
                        ids = prompts[i]["prompt_token_ids"]
                        prompt_part = (ids, output.prompt_logprobs or [None] * len(ids))
                generated[key] += len(completion.token_ids)
                if not (prefix or completion.text or completion.token_ids
                        or completion.finish_reason):
                    continue
                logprobs = None
                if request.logprobs is not None:
                    builder = builders.setdefault(key, CompletionLogprobs(self.tokenizer))
                    parts = [builder.build(*prompt_part)] if prompt_part else []
                    parts.append(builder.build(completion.token_ids, completion.logprobs or []))
                    logprobs = {k: [v for part in parts for v in part[k]] for k in parts[0]}
                choice = {"index": i * n + completion.index, "text": prefix + completion.text,
                          "logprobs": logprobs, "finish_reason": completion.finish_reason,
                          "stop_reason": completion.stop_reason}
                chunk = {"id": request_id, "object": "text_completion", "created": created,
                         "model": model, "choices": [choice]}
                if request.continuous_usage():  # this sample's prompt and tokens so far
                    chunk["usage"] = usage(len(prompts[i]["prompt_token_ids"]), generated[key])
                yield sse(chunk)
        if request.include_usage():
            yield sse({"id": request_id, "object": "text_completion", "created": created,
                       "model": model, "choices": [],
                       "usage": usage(_num_prompt_tokens(prompts), sum(generated.values()))})


@dataclass
class _EchoOnly:
    """What an echo-only request streams of a completion: nothing generated, its end."""

    index: int
    finish_reason: str | None
    text: str = ""
    token_ids: tuple = ()
    logprobs: None = None
    stop_reason: None = None


def _num_prompt_tokens(prompts: list[dict[str, Any]]) -> int:
    """Usage's prompt_tokens: each prompt once, whatever n is (OpenAI's and vLLM's count)."""
    return sum(len(p["prompt_token_ids"]) for p in prompts)

