"""What the offline API returns: vLLM's RequestOutput, CompletionOutput and Logprob."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's entry in a logprobs dict (vLLM's ``Logprob``).

    ``rank``: 1 = the most likely token of the position (ties share the better rank for the
    sampled / prompt token; the top-k get 1..k in order). ``decoded_token``: the tokenizer's
    decode of that single id (None without a tokenizer).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: {token id: Logprob}, the sampled (or actual prompt) token first, then the top-k.
TokenLogprobs = dict[int, Logprob]
# Per generated token; len == len(CompletionOutput.token_ids) always.
SampleLogprobs = list[TokenLogprobs]
# Per prompt token; None for the first (nothing predicts it).
PromptLogprobs = list[TokenLogprobs | None]


class RequestOutputKind(enum.IntEnum):
    """How a request's RequestOutputs are streamed (vLLM's values).

    CUMULATIVE: every update carries the whole text and token ids so far.
    DELTA: every update carries only what is new since the previous one.
    FINAL_ONLY: one RequestOutput, when the request (all n samples) has finished.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # Sum of the sampled tokens' logprobs; None unless SamplingParams.logprobs was set.
    cumulative_logprob: float | None = None
    # One dict per token of token_ids (DELTA: per new token); None unless logprobs was set.
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # The stop string or stop token id that ended the completion (None for EOS and length).
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # one per sample (n), ordered by index
    finished: bool
    # None, then one dict per prompt position >= 1; None unless SamplingParams.prompt_logprobs
    # was set. DELTA streams it once, in the first RequestOutput.
    prompt_logprobs: PromptLogprobs | None = None
    metrics: dict = field(default_factory=dict)
