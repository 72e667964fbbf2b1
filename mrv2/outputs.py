"""What the offline API returns: vLLM's RequestOutput and CompletionOutput."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


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
    cumulative_logprob: float | None = None
    logprobs: list | None = None
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
    prompt_logprobs: list | None = None
    metrics: dict = field(default_factory=dict)
