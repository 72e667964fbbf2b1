"""Turns a user prompt and SamplingParams (or, on a pooling engine, PoolingParams) into a
validated EngineCoreRequest.

Every check runs before the request reaches the engine core, so a bad prompt never disturbs
requests that were accepted before it. A pooling request becomes a one-token greedy request
(mrv2/pooling_params.py); an engine runs one kind only (ModelConfig.runner).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Union

from mrv2.config import EngineConfig
from mrv2.core.grammar import validate_structured_outputs
from mrv2.models.generation_config import eos_token_ids
from mrv2.pooling_params import PoolingParams, engine_sampling_params
from mrv2.protocol import EngineCoreRequest
from mrv2.sampling_params import MAX_LOGPROBS, SamplingParams

PromptType = Union[str, Mapping[str, Any]]


class PromptError(ValueError):
    """The prompt is empty, too long, or malformed."""


class UnsupportedParameterError(ValueError):
    """A SamplingParams field this engine does not implement yet was set."""


# vLLM's advice when a request does not fit the engine's runner.
GENERATE_ON_POOLING = ("LLM.generate() is only supported for generative models: this engine "
                       "pools (runner='pooling'); pass runner='generate' (--runner generate) "
                       "to use the model as a generative model")
POOLING_ON_GENERATE = ("LLM.embed() / encode() / score() are only supported for pooling models: "
                       "this engine generates; pass runner='pooling' (--runner pooling, or "
                       "--convert embed) to use the model as a pooling model")

class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        model_config = config.model_config
        eos_ids = eos_token_ids(model_config.hf_config, model_config.model,
                                getattr(tokenizer, "eos_token_id", None))
        # The primary EOS (the tokenizer's, else the config's first) ends a request with
        # stop_reason None; the model's other EOS ids end it like stop_token_ids, reporting
        # the id (vLLM adds them to the request's stop_token_ids). One shared tuple.
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        self.eos_stop_token_ids: tuple[int, ...] = eos_ids[1:]

    def process(self, request_id: str, prompt: PromptType,
                params: SamplingParams | PoolingParams) -> tuple[EngineCoreRequest, str | None]:
        """Returns the core request and the prompt text (None for token-id prompts)."""
        if isinstance(params, PoolingParams):
            return self._process_pooling(request_id, prompt, params)
        if self.config.model_config.runner == "pooling":
            raise ValueError(GENERATE_ON_POOLING)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        _check_logprobs(params)
        params.validate_for_vocab(self.config.model_config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise UnsupportedParameterError(
                f"SamplingParams.stop={params.stop!r} needs a tokenizer to detokenize the "
                f"output, and this model has none; use stop_token_ids")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise UnsupportedParameterError(
                    "SamplingParams.structured_outputs needs the model's tokenizer (its "
                    "vocabulary), and this model has none")
            validate_structured_outputs(params.structured_outputs,
                                        self.config.structured_outputs_config)
        text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids)
        request = EngineCoreRequest(request_id=request_id, prompt_token_ids=token_ids,
                                    sampling_params=params, eos_token_id=self.eos_token_id,
                                    arrival_time=time.time(),
                                    eos_stop_token_ids=self.eos_stop_token_ids)
        return request, text

    def resolve_pooling(self, params: PoolingParams) -> PoolingParams:
        """`params` resolved against this engine (task, normalize); ValueError on an engine
        that does not pool, or for a field the model cannot honour."""
        model_config = self.config.model_config
        if model_config.runner != "pooling":
            raise ValueError(POOLING_ON_GENERATE)
        return params.verify(params.task or "embed", model_config.hidden_size,
                             model_config.pooler_config.normalize)

    def _process_pooling(self, request_id: str, prompt: PromptType,
                         params: PoolingParams) -> tuple[EngineCoreRequest, str | None]:
        params = self.resolve_pooling(params)
        text, token_ids = self._tokenize(prompt)
        kept = params.truncate(token_ids, self.config.model_config.max_model_len)
        if len(kept) != len(token_ids):
            text = None  # the text of the whole prompt no longer matches the ids
        self._check_prompt(kept)
        request = EngineCoreRequest(request_id=request_id, prompt_token_ids=kept,
                                    sampling_params=engine_sampling_params(), eos_token_id=None,
                                    arrival_time=time.time())
        return request, text

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("the prompt is empty")
            if self.tokenizer is None:
                raise PromptError("text prompts need a tokenizer; pass prompt_token_ids")
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                        isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise PromptError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise PromptError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        raise PromptError(f"a prompt is a string or a dict with 'prompt_token_ids', "
                          f"got {type(prompt).__name__}")

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise PromptError("the prompt is empty")
        max_model_len = self.config.model_config.max_model_len
        if len(token_ids) >= max_model_len:
            why = ("so that at least one token can be generated"
                   if self.config.model_config.runner == "generate" else
                   "(mrv2 runs an embedding prompt as a one-token request; truncate_prompt_tokens "
                   "keeps its last tokens)")
            raise PromptError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is {max_model_len}: "
                f"the prompt must be shorter {why}")
        vocab = self.config.model_config.vocab_size
        low, high = min(token_ids), max(token_ids)
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise PromptError(f"token id {bad} is outside the vocabulary [0, {vocab})")


def _check_logprobs(params: SamplingParams) -> None:
    """Again here: a field set after construction skipped SamplingParams' own check, and the
    sampler's tables hold at most MAX_LOGPROBS per request."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 <= value <= MAX_LOGPROBS):
            raise ValueError(f"SamplingParams.{name}={value!r} is invalid: must be in "
                             f"[0, {MAX_LOGPROBS}]")
