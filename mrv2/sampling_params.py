"""SamplingParams: vLLM's names and defaults, validated on construction.

It is a msgspec Struct so that it crosses process boundaries inside the protocol structs
without pickling. Every invalid value raises ``ValueError`` naming the field and the value.
"""

from __future__ import annotations

import msgspec

MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.n >= 1, "n", self.n, "must be at least 1")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be non-negative")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= -1, "top_k", self.top_k, "must be -1 (disable), 0 (disable) or at least 1")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty,
               "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty,
               "must be in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty,
               "must be greater than 0")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be at least 1")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be non-negative")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"must not exceed max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(0 <= value <= MAX_LOGPROBS, name, value, f"must be in [0, {MAX_LOGPROBS}]")
        if self.stop_token_ids is not None:
            _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                   self.stop_token_ids, "must be non-negative token ids")
        if self.stop is not None:
            _check(all(s for s in self.stop), "stop", self.stop, "must not contain empty strings")

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def clone(self, **changes) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)


def _check(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {why}")
