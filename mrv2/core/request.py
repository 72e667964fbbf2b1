"""The scheduler's view of one request: its tokens, its progress and its status.

A `Request` lives in the engine core only (it never crosses a process boundary; the runner
learns about it through `NewRequestData` / `CachedRequestData`). Invariants:

- `all_token_ids == prompt_token_ids + output_token_ids`, always (both grow only through
  `append_output_token_ids`).
- `0 <= num_computed_tokens <= num_tokens`: tokens whose KV the runner has (or, once a step is
  scheduled, will have) written. Preemption resets it to 0 (recompute mode).
- `max_tokens` is resolved once, at construction, so the stop check never sees None.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from mrv2.protocol import NEVER_DRAFTS, EngineCoreRequest, FinishReason
from mrv2.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mrv2.core.structured_output import RequestGrammar

logger = logging.getLogger(__name__)


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Every status from here on is final; `is_finished` relies on this ordering.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        """The protocol's reason for a final status; None while the request is alive."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """Mutable per-request scheduling state. Owned and mutated by the `Scheduler` only."""

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 sampling_params: SamplingParams, eos_token_id: int | None = None,
                 arrival_time: float = 0.0, max_model_len: int | None = None,
                 eos_stop_token_ids: tuple[int, ...] = ()) -> None:
        self.request_id = request_id
        # Copied: the caller's list (or a frozen protocol struct's list) must not alias ours.
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        # The model's other EOS ids (EngineCoreRequest.eos_stop_token_ids): a small tuple (the
        # input processor's own, in process); the stop check tests membership once per token.
        self.eos_stop_token_ids = tuple(eos_stop_token_ids)
        self.arrival_time = arrival_time

        if sampling_params.max_tokens is not None:
            self.max_tokens: int = sampling_params.max_tokens
        elif max_model_len is not None:
            # vLLM's default: generate until the context is full. May be <= 0 for a prompt
            # that already fills the context; the scheduler rejects such requests.
            self.max_tokens = max_model_len - len(self.prompt_token_ids)
        else:
            raise ValueError(f"request {request_id!r}: sampling_params.max_tokens is None, "
                             "so max_model_len is needed to resolve it")

        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens a scheduled, still running step will sample (async scheduling); never part
        # of all_token_ids, so they are never hashed or cached.
        self.num_output_placeholders = 0
        # Speculative decoding: drafts the runner holds for the request's next step (its last
        # output says how many), and drafts the step in flight verifies.
        self.num_draft_tokens = 0
        self.num_scheduled_drafts = 0
        self.draft_token_ids: list[int] = []  # the runner's drafts (take_drafts)
        # Decode steps it makes before the runner may draft for it again (its last output
        # says): a run of decode steps no longer than that (core/decode_steps.py).
        self.steps_without_drafts = NEVER_DRAFTS
        self.status = RequestStatus.WAITING
        # The stop token id that finished the request: a stop_token_id or one of
        # eos_stop_token_ids (None for the primary EOS, length or abort).
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Prefix-cache hit (tokens) of its first admission; -1 until then (vLLM's).
        self.num_cached_tokens = -1
        # The grammar of a structured-output request (core/structured_output.py); None for
        # every other request, and once the request is freed.
        self.grammar: RequestGrammar | None = None

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, max_model_len: int) -> "Request":
        return cls(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                   sampling_params=req.sampling_params, eos_token_id=req.eos_token_id,
                   arrival_time=req.arrival_time, max_model_len=max_model_len,
                   eos_stop_token_ids=req.eos_stop_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + outputs. The live list, for speed: callers must copy before keeping it."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Prompt logprobs need the logits of every prompt position, so a request that asked
        for them computes its whole prompt (vLLM does the same). Once it sampled, its prompt
        logprobs were delivered: a resumption may read the cache again."""
        return self.sampling_params.prompt_logprobs is not None and not self.output_token_ids

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """The only way tokens are added: keeps output_token_ids and all_token_ids in step."""
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
            return
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            self._all_token_ids.append(token_id)

    def take_drafts(self, drafts: list[int], pause: int) -> None:
        """The drafts the runner holds for the request's next step, after its last token, and
        the decode steps before it may draft again (`pause`); a grammar keeps the run of the
        drafts it accepts (the rest are not verified)."""
        self.steps_without_drafts = pause
        if self.grammar is not None and drafts and not self.is_finished:
            drafts = drafts[:self.grammar.num_valid(drafts)]
        self.draft_token_ids = drafts
        self.num_draft_tokens = len(drafts)

    def check_stop(self, max_model_len: int) -> bool:
        """vLLM's check_stop, after each appended token: sets the final status and returns
        True when the request ends here. Length wins over a stop token."""
        output_token_ids = self.output_token_ids
        num_output = len(output_token_ids)
        last = output_token_ids[-1]
        grammar = self.grammar
        if grammar is not None and not grammar.accept_token(last):
            logger.error("request %s: its grammar rejected token %d; finished with an error",
                         self.request_id, last)
            self.status = RequestStatus.FINISHED_ERROR
            return True
        if (num_output >= self.max_tokens
                or len(self.all_token_ids) >= max_model_len):
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        params = self.sampling_params
        if num_output < params.min_tokens:
            return False
        if not params.ignore_eos:
            if last == self.eos_token_id:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in self.eos_stop_token_ids:  # the model's other EOS ids (vLLM)
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if (params.stop_token_ids and last in params.stop_token_ids
                or grammar is not None and grammar.is_terminated):  # its stop token, accepted
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = last
            return True
        return False

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"prompt={self.num_prompt_tokens}, outputs={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")
