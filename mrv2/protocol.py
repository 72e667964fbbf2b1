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


class ModelRunnerOutput(msgspec.Struct, array_like=True, frozen=True):
    req_ids: list[str]
    # One list per request; empty for a prefill chunk that did not finish its prompt.
    sampled_token_ids: list[list[int]]
    # Per request: None unless it asked for logprobs (and sampled this step).
    logprobs: list[SampleLogprobs | None] | None = None
    num_nans: int = 0


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, frozen=True):
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
