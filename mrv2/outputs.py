"""What the offline API returns: vLLM's RequestOutput, CompletionOutput and Logprob, the
per-request stats of `RequestOutput.metrics` (vLLM v1's RequestStateStats), the metric
objects of `LLM.get_metrics()` (vLLM's vllm.v1.metrics.reader types) and the pooling outputs
of `LLM.encode` / `embed` / `score` (vLLM's PoolingRequestOutput and its views)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:  # torch stays out of the modules the engine core imports
    import torch


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
class RequestStateStats:
    """vLLM v1's per-request stats, as far as mrv2 tracks them. `arrival_time` is wall-clock
    (time.time()); the `*_ts` fields are time.monotonic(): `queued_ts` when the front end
    queued the request, `first_token_ts` / `last_token_ts` the engine core's timestamps of the
    steps that produced the first and the latest token. `scheduled_ts` stays 0.0: the core
    does not report when it first scheduled a request. `first_token_latency`: seconds from
    arrival to the first token, measured where the outputs are processed (as vLLM does)."""

    num_generation_tokens: int = 0
    arrival_time: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0


@dataclass
class Metric:
    """One metric of `LLM.get_metrics()` (vLLM's reader types): a Prometheus-style name
    (`vllm:` prefix) and its labels."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing count."""

    value: int


@dataclass
class Gauge(Metric):
    """A value that goes up and down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets: `buckets` maps each upper limit (as a string, "+Inf" last) to
    the cumulative count of observations at or below it; `count` and `sum` of them all."""

    count: int
    sum: float
    buckets: dict[str, int]


@dataclass
class Vector(Metric):
    """An ordered array of counters (vLLM's, for speculative decoding: accepted drafts per
    position)."""

    values: list[int]


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
    # The request's live stats (shared by its outputs, as vLLM's); None when built outside
    # the engine. For n > 1: those of the sample that produced this output.
    metrics: RequestStateStats | None = None
    # Prompt tokens whose KV came from the prefix cache when the request was first scheduled
    # (vLLM's; whole blocks, never the last prompt token; 0 with prefix caching off).
    num_cached_tokens: int = 0


@dataclass
class PoolingOutput:
    """A pooling request's result: its embedding, a 1-D float32 tensor (vLLM's)."""

    data: torch.Tensor


def pooled_tensor(pooled: bytes, normalize: bool) -> torch.Tensor:
    """The engine's pooled hidden states (float32 bytes) as a tensor, L2-normalised when
    asked."""
    import numpy as np
    import torch

    data = torch.from_numpy(np.frombuffer(pooled, dtype=np.float32).copy())
    if normalize:
        data = torch.nn.functional.normalize(data, p=2.0, dim=-1)
    return data


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    score: float


_O = TypeVar("_O")


@dataclass
class PoolingRequestOutput(Generic[_O]):
    """vLLM's: `outputs` is a PoolingOutput (LLM.encode), an EmbeddingOutput (LLM.embed) or a
    ScoringOutput (LLM.score)."""

    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @staticmethod
    def from_base(output: PoolingRequestOutput[PoolingOutput]) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(output.request_id,
                                      EmbeddingOutput(output.outputs.data.tolist()),
                                      output.prompt_token_ids, output.num_cached_tokens,
                                      output.finished)


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    pass
