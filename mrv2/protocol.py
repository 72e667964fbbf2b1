"""Messages that cross a process boundary (DESIGN.md section 3).

Everything here is a msgspec Struct encoded with msgpack: scheduler -> worker
(`SchedulerOutput`, `GrammarOutput`), worker -> scheduler (`ModelRunnerOutput`) and
front end <-> engine core (`EngineCoreRequest`, `EngineCoreOutputs`). Nothing is pickled.
"""

from __future__ import annotations

import enum

import msgspec

from mrv2.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, frozen=True):
    """A request the runner has not seen yet (or is resuming after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    # Prompt plus the outputs generated before a preemption; equals the prompt otherwise.
    prefill_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct, array_like=True, frozen=True):
    """Running requests, as parallel lists. `new_block_ids` holds only the delta of this step."""

    req_ids: list[str] = []
    new_block_ids: list[list[int]] = []
    num_computed_tokens: list[int] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class SchedulerOutput(msgspec.Struct, array_like=True, frozen=True):
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # Insertion order is the batch order: running requests (decodes) first.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str] = []
    preempted_req_ids: list[str] = []

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class GrammarOutput(msgspec.Struct, array_like=True, frozen=True):
    """Structured-output token masks per request; empty until grammars are supported."""

    req_ids: list[str] = []
    bitmask: bytes | None = None


class SampleLogprobs(msgspec.Struct, array_like=True, frozen=True):
    """One sampled token's logprobs: the sampled token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # rank of the sampled token (1 = most likely)


class PromptLogprobsChunk(msgspec.Struct, array_like=True, frozen=True):
    """Prompt logprobs of the prompt positions one step computed for one request.

    Row i is prompt position ``start + i``: ``token_ids[i][0]`` is the actual next prompt token
    (position ``start + i + 1``) with its logprob and ``ranks[i]``, then the top-k of the
    position (their ranks are 1..k). Raw logprobs, whatever the logprobs_mode.
    """

    start: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    @property
    def num_rows(self) -> int:
        return len(self.ranks)


class ModelRunnerOutput(msgspec.Struct, array_like=True, frozen=True):
    req_ids: list[str]
    # One list per request; empty for a prefill chunk that did not finish its prompt.
    sampled_token_ids: list[list[int]]
    # Per request: None unless it asked for logprobs (and sampled this step).
    logprobs: list[SampleLogprobs | None] | None = None
    num_nans: int = 0
    # Requests that asked for prompt logprobs and computed prompt positions this step; None
    # when no request of the batch did.
    prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


class EngineCoreRequest(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float


class EngineCoreOutput(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    # The stop token id that ended the request, when it was a stop_token_id.
    stop_reason: int | str | None = None
    # One entry per new token (same length as new_token_ids); None unless it asked for logprobs.
    new_logprobs: list[SampleLogprobs] | None = None
    # The prompt positions computed this step; an output may carry only these (no new token)
    # for a prefill chunk of a request that asked for prompt logprobs.
    new_prompt_logprobs: PromptLogprobsChunk | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, frozen=True):
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
