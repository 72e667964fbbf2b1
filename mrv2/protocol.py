"""Messages that cross a process boundary (DESIGN.md section 3).

Everything here is a msgspec Struct encoded with msgpack: scheduler -> worker
(`SchedulerOutput`, `GrammarOutput`), worker -> scheduler (`ModelRunnerOutput`) and
front end <-> engine core (`EngineCoreRequest`, `EngineCoreOutputs`, the utility calls, the
core's start-up and failure reports; their framing is mrv2/core_framing.py). Nothing is
pickled.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from executor.packed import (int32_bytes, int32_view, is_id_prefix, pack_ids, pack_ragged,
                             unpack_ids, unpack_ragged)
from mrv2.sampling_params import SamplingParams

# Block 0 is the null block: the KV cache manager never hands it to a request, and block-table
# rows are padded with it (a padded row's KV writes land there and are never read).
NULL_BLOCK_ID = 0


class NewRequestData(msgspec.Struct, array_like=True, frozen=True):
    """A request the runner has not seen yet (or is resuming after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    # Prompt plus the outputs generated before a preemption; equals the prompt otherwise.
    prefill_token_ids: list[int]
    sampling_params: SamplingParams
    # One list per KV cache group (core/kv_cache_layout.py); a windowed group's entries
    # behind its window may be the null block.
    block_ids: list[list[int]]
    num_computed_tokens: int
    # The request's primary EOS, which min_tokens masks with the model's EOS ids (the runner
    # knows those, but not a tokenizer-only EOS).
    eos_token_id: int | None = None
    # The request's other EOS ids (EngineCoreRequest's): with the primary one and its
    # stop_token_ids, exactly the ids the scheduler's stop check ends it on (a run of decode
    # steps ends early on them: mrv2/sampler/run_stops.py).
    eos_stop_token_ids: tuple[int, ...] = ()


class CachedRequestData(msgspec.Struct, array_like=True, frozen=True):
    """Running requests, packed (executor/packed.py): ids, then per request its count of tokens
    computed before this step and only this step's delta of new block ids, per KV cache group.
    Build with `build`; read through the properties."""

    req_ids_packed: bytes = b""
    num_reqs: int = 0
    num_computed_tokens_i32: bytes = b""
    # Flat, group after group and within a group request after request.
    new_block_ids_i32: bytes = b""
    num_new_blocks_i32: bytes = b""  # [num_kv_groups * num_reqs], the same order
    num_kv_groups: int = 1

    @classmethod
    def build(cls, req_ids: Sequence[str], new_block_ids: Sequence[Sequence[Sequence[int]]],
              num_computed_tokens: Sequence[int] | np.ndarray) -> CachedRequestData:
        """`new_block_ids[i][g]`: request i's new blocks in group g (as many groups each)."""
        if not len(req_ids) == len(new_block_ids) == len(num_computed_tokens):
            raise ValueError(f"{len(req_ids)} ids, {len(new_block_ids)} block-id lists and "
                             f"{len(num_computed_tokens)} computed counts")
        num_groups = len(new_block_ids[0]) if len(new_block_ids) else 1
        if any(len(delta) != num_groups for delta in new_block_ids):
            raise ValueError(f"every request needs {num_groups} block-id lists")
        flat, counts = pack_ragged([delta[0] for delta in new_block_ids] if num_groups == 1 else
                                   [delta[g] for g in range(num_groups) for delta in new_block_ids])
        return cls(pack_ids(req_ids), len(req_ids), int32_bytes(num_computed_tokens), flat,
                   counts, num_groups)

    @property
    def req_ids(self) -> list[str]:
        """A new list on each access: split once and keep it."""
        return unpack_ids(self.req_ids_packed, self.num_reqs)

    @property
    def num_computed_tokens(self) -> np.ndarray:
        return int32_view(self.num_computed_tokens_i32)

    @property
    def new_block_ids_flat(self) -> np.ndarray:
        """Every group's new block ids, group after group."""
        return int32_view(self.new_block_ids_i32)

    @property
    def num_new_blocks(self) -> np.ndarray:
        """[num_kv_groups, num_reqs]: how many new block ids each request has per group."""
        return int32_view(self.num_new_blocks_i32).reshape(self.num_kv_groups, self.num_reqs)

    @property
    def new_block_ids(self) -> list[list[list[int]]]:
        """Per request, per group, its new block ids (off the step path)."""
        per_group = unpack_ragged(self.new_block_ids_flat, self.num_new_blocks.reshape(-1))
        return [[per_group[g * self.num_reqs + i] for g in range(self.num_kv_groups)]
                for i in range(self.num_reqs)]


class SchedulerOutput(msgspec.Struct, array_like=True, frozen=True):
    """One step. The scheduled requests in batch order (running requests first, so the ids
    of `scheduled_cached_reqs` are a prefix), with their token counts. Build with `build`."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    req_ids_packed: bytes
    num_reqs: int
    num_scheduled_i32: bytes
    total_num_scheduled_tokens: int
    finished_req_ids: list[str] = []
    preempted_req_ids: list[str] = []
    # > 1: every row decodes (one token each) by argmax, and the runner runs this many decode
    # steps, sampling as many tokens per row (core/decode_steps.py).
    num_decode_steps: int = 1
    # Speculative decoding: the chance of acceptance a draft needs to pay for its row
    # (core/draft_policy.py); every rank's drafts follow it.
    draft_threshold: float = 0.0

    @classmethod
    def build(cls, scheduled_new_reqs: list[NewRequestData],
              scheduled_cached_reqs: CachedRequestData,
              num_scheduled_tokens: Mapping[str, int], total_num_scheduled_tokens: int,
              finished_req_ids: list[str] | None = None,
              preempted_req_ids: list[str] | None = None,
              num_decode_steps: int = 1, draft_threshold: float = 0.0) -> SchedulerOutput:
        """`num_scheduled_tokens`: req_id -> tokens, in batch order (insertion order)."""
        return cls(scheduled_new_reqs, scheduled_cached_reqs,
                   pack_ids(list(num_scheduled_tokens)), len(num_scheduled_tokens),
                   int32_bytes(list(num_scheduled_tokens.values())),
                   total_num_scheduled_tokens, finished_req_ids or [], preempted_req_ids or [],
                   num_decode_steps, draft_threshold)

    @property
    def req_ids(self) -> list[str]:
        """Batch order; a new list on each access."""
        return unpack_ids(self.req_ids_packed, self.num_reqs)

    @property
    def num_scheduled(self) -> np.ndarray:
        """Tokens per request, batch order (int32, read-only)."""
        return int32_view(self.num_scheduled_i32)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """req_id -> tokens in batch order, for consumers off the step path."""
        return dict(zip(self.req_ids, self.num_scheduled.tolist()))

    @property
    def cached_rows_first(self) -> bool:
        """Whether the running requests are the first rows of the batch (the scheduler's
        order), so their slots need no second lookup."""
        cached = self.scheduled_cached_reqs
        return is_id_prefix(self.req_ids_packed, self.num_reqs, cached.req_ids_packed,
                            cached.num_reqs)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class GrammarOutput(msgspec.Struct, array_like=True, frozen=True):
    """The token masks of one step's grammar-constrained rows (core/structured_output.py).

    `rows` index the step's SchedulerOutput.req_ids (the scheduler's order); a row repeated m
    times in a run masks its request's first m verify rows. `bitmask`: [len(rows), ceil(vocab
    / 32)] int32, xgrammar's layout (token t allowed in row i iff bit t % 32 of word t // 32)."""

    rows_i32: bytes = b""
    bitmask_i32: bytes = b""
    num_rows: int = 0

    @classmethod
    def build(cls, rows: Sequence[int], bitmask: np.ndarray) -> GrammarOutput:
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or len(bitmask) != len(rows):
            raise ValueError(f"bitmask must be int32 [{len(rows)}, words], got "
                             f"{bitmask.dtype} {bitmask.shape}")
        return cls(int32_bytes(rows), np.ascontiguousarray(bitmask).tobytes(), len(rows))

    @property
    def rows(self) -> np.ndarray:
        return int32_view(self.rows_i32)

    @property
    def bitmask(self) -> np.ndarray:
        """[num_rows, words] int32, read-only."""
        words = int32_view(self.bitmask_i32)
        return words.reshape(self.num_rows, -1) if self.num_rows else words.reshape(0, 0)


class SampledTokenLogprobs(msgspec.Struct, array_like=True, frozen=True):
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


# A request's draft pause (ModelRunnerOutput.draft_pauses) where the runner never drafts for
# it (prompt logprobs), and before any output: no bound on its runs of decode steps.
NEVER_DRAFTS = 2**31 - 1


class ModelRunnerOutput(msgspec.Struct, array_like=True, frozen=True):
    """One step's results in batch order, packed (executor/packed.py). Build with `build`."""

    req_ids_packed: bytes
    num_reqs: int
    # Flat, request after request; a prefill chunk that did not finish its prompt has none.
    sampled_i32: bytes
    num_sampled_i32: bytes
    # Per request: None unless it asked for logprobs (and sampled this step); one per token.
    logprobs: list[list[SampledTokenLogprobs] | None] | None = None
    # Requests that asked for prompt logprobs and computed prompt positions this step; None
    # when no request of the batch did.
    prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None
    # Requests whose logits row held a NaN this step: their sampled token
    # is a valid id but meaningless, so the scheduler ends them with finish_reason "error".
    nan_req_ids: list[str] = []
    # A pooling runner's requests that completed their prefill this step: their pooled hidden
    # states, float32 bytes (mrv2/state/pooling.py); None on a generate runner.
    pooled: dict[str, bytes] | None = None
    # Per request, the drafts the runner holds for its next step (b"": none), then the drafts,
    # then the decode steps it makes before it may draft again (spec_decode/drafts.py).
    num_draft_tokens_i32: bytes = b""
    draft_token_ids_i32: bytes = b""
    draft_pauses_i32: bytes = b""

    @classmethod
    def build(cls, req_ids: Sequence[str], sampled_token_ids: Sequence[Sequence[int]],
              logprobs: list[list[SampledTokenLogprobs] | None] | None = None,
              prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None,
              nan_req_ids: Sequence[str] = (),
              pooled: dict[str, bytes] | None = None) -> ModelRunnerOutput:
        if len(req_ids) != len(sampled_token_ids):
            raise ValueError(f"{len(req_ids)} ids and {len(sampled_token_ids)} token lists")
        flat, counts = pack_ragged(sampled_token_ids)
        return cls(pack_ids(req_ids), len(req_ids), flat, counts, logprobs, prompt_logprobs,
                   list(nan_req_ids), pooled)

    @property
    def req_ids(self) -> list[str]:
        """A new list on each access: split once and keep it."""
        return unpack_ids(self.req_ids_packed, self.num_reqs)

    @property
    def sampled(self) -> np.ndarray:
        return int32_view(self.sampled_i32)

    @property
    def num_sampled(self) -> np.ndarray:
        return int32_view(self.num_sampled_i32)

    @property
    def draft_token_ids(self) -> list[list[int]] | None:
        """Per request, the drafts the runner holds (None when no request has any)."""
        return None if not self.num_draft_tokens_i32 else unpack_ragged(
            int32_view(self.draft_token_ids_i32), int32_view(self.num_draft_tokens_i32))

    @property
    def draft_pauses(self) -> np.ndarray | None:
        """Per request, the decode steps it makes before the runner may draft for it again
        (None without speculative decoding)."""
        return int32_view(self.draft_pauses_i32) if self.draft_pauses_i32 else None

    @property
    def sampled_token_ids(self) -> list[list[int]]:
        """One list per request (a new one on each access)."""
        return unpack_ragged(self.sampled, self.num_sampled)


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3  # the engine failed this request alone (vLLM's "error"), e.g. NaN logits

    def __str__(self) -> str:
        return ("stop", "length", "abort", "error")[self.value]


class EngineCoreRequest(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # The primary EOS: ends the request (unless ignore_eos) with stop_reason None.
    eos_token_id: int | None
    arrival_time: float
    # The model's other EOS ids (mrv2/models/generation_config.py): end the request (unless
    # ignore_eos) like stop_token_ids, stop_reason = the id (as vLLM). Never holds eos_token_id.
    eos_stop_token_ids: tuple[int, ...] = ()


class EngineCoreOutput(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    # The stop token id that ended the request, when it was a stop_token_id.
    stop_reason: int | str | None = None
    # One entry per new token (same length as new_token_ids); None unless it asked for logprobs.
    new_logprobs: list[SampledTokenLogprobs] | None = None
    # The prompt positions computed this step; an output may carry only these (no new token)
    # for a prefill chunk of a request that asked for prompt logprobs.
    new_prompt_logprobs: PromptLogprobsChunk | None = None
    # Prompt tokens found in the prefix cache when the request was first scheduled (vLLM's).
    num_cached_tokens: int = 0
    # A pooling request's pooled hidden states (float32 bytes, not normalised), with the
    # output that finishes it.
    pooled: bytes | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, frozen=True):
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0


# ----------------------------------------------------------------------------------------------
# Front end <-> engine-core process (mrv2/engine/client.py <-> mrv2/core/core_proc.py)


class UtilityCall(msgspec.Struct, array_like=True, frozen=True):
    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, array_like=True, frozen=True):
    call_id: int
    result: Any = None
    error: str | None = None  # the exception's message, when the call raised
    exc_type: str = ""
    traceback: str = ""


class RequestRejected(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    exc_type: str
    message: str


class CoreDead(msgspec.Struct, array_like=True, frozen=True):
    reason: str


class CoreReady(msgspec.Struct, array_like=True, frozen=True):
    """The core's start-up message, over its ready pipe (not a socket)."""

    pid: int
    error: str | None = None  # start-up traceback
    exc_type: str = ""
    num_kv_blocks: int = 0


class CoreStats(msgspec.Struct, kw_only=True):
    """What the `get_stats` utility returns: the scheduler's view of the core right now."""

    num_running: int
    num_waiting: int
    num_unfinished: int  # requests the scheduler holds (running + waiting)
    has_unfinished: bool  # ... or finished ids not yet sent to the runner, or steps in flight
    kv_cache_usage: float  # fraction of KV blocks held by requests
    num_free_blocks: int
    num_kv_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_decode: list[int] = []  # SpecDecodeStats.totals ([]: no speculative decoding)
