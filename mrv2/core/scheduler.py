"""vLLM v1 style scheduler: one token budget shared by decodes and (chunked) prefills.

No separate prefill and decode phases: each step gives each request up to `num_tokens` (prompt
+ outputs) - `num_computed_tokens`, within `max_num_batched_tokens`.

Invariants:
- `running` is in admission order; preemption takes the newest (the tail), so the oldest running
  request always progresses. With the `add_request` guard (a request's whole life fits in the
  pool) this means no livelock: alone, a request always fits.
- `num_computed_tokens` is advanced when a step is scheduled, not when it returns (vLLM's
  `_update_after_schedule`), so a second step could be scheduled before the first returns.
- A request's blocks are freed exactly once, when it finishes, is aborted or is preempted; its
  id is sent in `finished_req_ids` exactly once.
- Prefix caching: a waiting request is admitted with `num_computed_tokens` = its cache hit
  (whole blocks, always < num_tokens, so the last token is computed and sampled from); only
  the rest is scheduled. Blocks shared through hits are reference counted by the manager.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from executor.packed import check_id
from mrv2.core.decode_steps import AutoRunLength, decode_steps
from mrv2.core.draft_policy import DraftPolicy
from mrv2.core.block_pool import PrefixCacheStats
from mrv2.core.kv_cache_manager import GroupBlockIds, KVCacheManager
from mrv2.core.request import Request, RequestStatus
from mrv2.core.spec_decode_stats import SpecDecodeStats
from mrv2.core.structured_output import StructuredOutputManager
from mrv2.protocol import (CachedRequestData, EngineCoreOutput, FinishReason, GrammarOutput,
                           ModelRunnerOutput, NewRequestData, SchedulerOutput)

if TYPE_CHECKING:  # config.py imports torch; the scheduler itself needs none of it
    from mrv2.config import EngineConfig

logger = logging.getLogger(__name__)


class Scheduler:

    def __init__(self, config: EngineConfig, num_kv_blocks: int) -> None:
        sched = config.scheduler_config
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.enable_chunked_prefill = sched.enable_chunked_prefill
        self.async_scheduling = sched.async_scheduling
        self.num_scheduler_steps = sched.num_scheduler_steps
        # Under pipeline stages a step takes 1/micro_batches of the requests (mrv2/pipeline.py)
        self.micro_batches = (config.max_steps_in_flight
                              if config.parallel_config.pipeline_parallel_size > 1 else 1)
        self.speculative = spec = config.speculative_config  # None: no drafts
        self.run_length = AutoRunLength(timed=spec is None)  # of the runs made by default
        self.spec_stats = SpecDecodeStats(0 if spec is None else spec.num_speculative_tokens)
        self.draft_policy = (None if spec is None else DraftPolicy(  # drafts, a row's cost
            spec, self.max_num_seqs, config.model_config.max_model_len))
        # KV slots past a step's tokens (a draft model's drafts: SpeculativeConfig)
        self.num_lookahead = 0 if spec is None else spec.num_lookahead_tokens
        self.max_model_len = config.model_config.max_model_len
        self.block_size = config.cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_kv_blocks, self.block_size, self.max_model_len,
            enable_caching=config.cache_config.enable_prefix_caching,
            layout=config.model_config.kv_cache_layout,
            max_new_tokens=config.max_kv_tokens_per_step)

        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()  # FIFO; preempted requests re-enter at the front
        self.running: list[Request] = []  # admission order
        # Finished or aborted since the last schedule(); sent once, then cleared.
        self._finished_req_ids: list[str] = []
        self.num_preemptions = 0
        self.structured_outputs = StructuredOutputManager(config)
        # Requests whose grammar failed to compile, reported by the next update_from_output.
        self._grammar_failures: list[EngineCoreOutput] = []

    # -- requests in and out --------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError for one that could never run to completion."""
        req_id = request.request_id
        if req_id in self.requests:
            raise ValueError(f"request {req_id!r} is already queued")
        check_id(req_id)  # step messages pack the ids (executor/packed.py)
        prompt_len = request.num_prompt_tokens
        if prompt_len == 0:
            raise ValueError(f"request {req_id!r} has an empty prompt")
        if prompt_len >= self.max_model_len:
            raise ValueError(f"request {req_id!r}: prompt of {prompt_len} tokens leaves no room "
                             f"to generate within max_model_len={self.max_model_len}")
        if request.max_tokens < 1:
            raise ValueError(f"request {req_id!r}: max_tokens={request.max_tokens} < 1")
        # The last token is sampled but never fed back, so at most this many get KV. Checking
        # the whole life (not just the prompt) is what rules out livelock: a request that can
        # outgrow the pool would preempt itself and never be re-admitted.
        max_kv_tokens = min(prompt_len + request.max_tokens, self.max_model_len) - 1
        manager = self.kv_cache_manager
        if manager.num_blocks_for(max_kv_tokens) > manager.num_allocatable_blocks:
            raise ValueError(f"request {req_id!r} may need {manager.num_blocks_for(max_kv_tokens)}"
                             f" KV blocks ({max_kv_tokens} tokens) but the pool has "
                             f"{manager.num_allocatable_blocks}")
        request.status = RequestStatus.WAITING
        self.requests[req_id] = request
        self.waiting.append(request)
        self.structured_outputs.add_request(request)  # its grammar compiles meanwhile

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish (typically abort) requests, waiting or running. Unknown ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        to_finish = {rid: self.requests[rid] for rid in req_ids if rid in self.requests}
        if not to_finish:
            return
        # One pass per queue rather than a list.remove per request.
        self.running = [r for r in self.running if r.request_id not in to_finish]
        self.waiting = deque(r for r in self.waiting if r.request_id not in to_finish)
        for request in to_finish.values():
            request.status = status
            self._free_finished(request)

    def _free_finished(self, request: Request) -> None:
        # `self.requests` membership is the single "not yet freed" flag: it is removed here,
        # and every path to this method checks it first, so blocks and ids go out once.
        del self.requests[request.request_id]
        self.kv_cache_manager.free(request)
        self.structured_outputs.remove_request(request)
        self._finished_req_ids.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_finished_requests(self) -> bool:
        """Finished ids not yet sent: the core should still call schedule() to deliver them."""
        return bool(self._finished_req_ids)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by requests; cached-but-free blocks count as free."""
        return self.kv_cache_manager.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Lookups (queries, hits in tokens) since the last `.reset()`; zeros when off."""
        return self.kv_cache_manager.prefix_cache_stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (False, doing nothing, while a request holds blocks)."""
        return self.kv_cache_manager.reset_prefix_cache()

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}  # insertion order is the batch order
        cached_ids: list[str] = []
        cached_new_blocks: list[GroupBlockIds] = []
        cached_num_computed: list[int] = []
        new_reqs: list[NewRequestData] = []
        preempted_ids: list[str] = []
        scheduled: list[Request] = []

        # 1. Running requests, oldest first. Victims are popped from the tail, so a victim is
        # never a request already scheduled in this step (those sit before `idx`).
        idx = 0
        running, manager, max_model_len = self.running, self.kv_cache_manager, self.max_model_len
        num_steps = decode_steps(running, len(self.waiting), self.num_scheduler_steps,
                                 max_model_len, manager.num_free_blocks // manager.num_groups,
                                 self.block_size, self.run_length.steps)  # > 1: rows decode
        row_cap = (-(-(len(running) + len(self.waiting)) // self.micro_batches)
                   if self.micro_batches > 1 else self.max_num_seqs)
        while idx < len(running) and budget > 0 and len(scheduled) < row_cap:
            request = running[idx]
            placeholders = request.num_output_placeholders
            known = len(request.all_token_ids) + placeholders
            num_new = min(known - request.num_computed_tokens, budget)
            # Nothing to run: its last step's output never arrived, or (async) the steps in
            # flight already produce every token it may still generate.
            if num_new <= 0 or (placeholders and (
                    self.speculative is not None  # its drafts come with the step in flight
                    or self.micro_batches > 1  # stages before the last need its token first
                    or len(request.output_token_ids) + placeholders >= request.max_tokens
                    or known >= max_model_len)):
                idx += 1
                continue
            if request.num_draft_tokens and num_new == 1:  # a decode: verify its drafts too
                request.num_scheduled_drafts = self.draft_policy.num_drafts(request, budget,
                                                                            len(running))
                num_new += request.num_scheduled_drafts
            span = min(num_new + num_steps - 1 + self.num_lookahead,  # tokens whose KV the
                       max_model_len - request.num_computed_tokens)  # step writes
            new_blocks = manager.allocate_slots(request, span)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted_ids.append(victim.request_id)
                if victim is request:
                    break
                new_blocks = manager.allocate_slots(request, span)
            if new_blocks is None:  # it preempted itself; it was the tail, so the loop ends
                break
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            cached_ids.append(request.request_id)
            cached_new_blocks.append(new_blocks)
            cached_num_computed.append(request.num_computed_tokens)
            scheduled.append(request)
            idx += 1

        # 2. Waiting requests, FIFO. Skipped after a preemption (as vLLM does): the pool is
        # short, and admitting now would only preempt again next step.
        compiling: list[Request] = []  # their grammar is not ready: they keep their place
        while (not preempted_ids and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs and len(scheduled) < row_cap):
            request = self.waiting[0]
            if request.grammar is not None and not self._grammar_ready(request):
                if not request.is_finished:
                    compiling.append(self.waiting.popleft())
                continue
            # Waiting requests hold no KV (new, or preempted in recompute mode). The longest
            # cached prefix of prompt (+ outputs, when resumed) is reused, never the last token.
            hit_blocks, num_hit = manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if not self.enable_chunked_prefill and num_new > budget:
                break  # whole prompts only; FIFO, so nothing behind it jumps the queue
            num_new = min(num_new, budget)
            if manager.allocate_slots(request, min(num_new + self.num_lookahead,
                                                   max_model_len - num_hit), hit_blocks) is None:
                break
            if manager.enable_caching:
                self.prefix_cache_stats.record(request.num_tokens, num_hit)
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:  # a resumption keeps its first admission's hit
                request.num_cached_tokens = num_hit
            new_reqs.append(NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                # Prompt + outputs so far: a resumed request recomputes its whole history,
                # less what the prefix cache still holds (num_computed_tokens).
                prefill_token_ids=list(request.all_token_ids),
                sampling_params=request.sampling_params,
                block_ids=list(manager.get_block_ids(request.request_id)),
                num_computed_tokens=request.num_computed_tokens,
                eos_token_id=request.eos_token_id, eos_stop_token_ids=request.eos_stop_token_ids))
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            scheduled.append(request)
        self.waiting.extendleft(reversed(compiling))

        output = SchedulerOutput.build(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=CachedRequestData.build(
                req_ids=cached_ids, new_block_ids=cached_new_blocks,
                num_computed_tokens=cached_num_computed),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=preempted_ids, num_decode_steps=num_steps,
            draft_threshold=(0.0 if self.draft_policy is None
                             else self.draft_policy.threshold(len(scheduled))))
        self._finished_req_ids = []  # a fresh list: the output keeps the old one
        async_scheduling = self.async_scheduling
        for request in scheduled:
            request.num_computed_tokens += num_scheduled[request.request_id] + num_steps - 1
            if (async_scheduling and request.num_computed_tokens
                    >= len(request.all_token_ids) + request.num_output_placeholders):
                # This step reaches the end of the known tokens: it samples one a decode step.
                request.num_output_placeholders += num_steps
        return output

    def _grammar_ready(self, request: Request) -> bool:
        """Whether the request's grammar compiled; one that failed finishes the request
        (popped from `waiting`) with finish_reason "error"."""
        grammar = request.grammar
        if not grammar.is_ready:
            return False
        if grammar.error is None:
            grammar.start()
            return True
        logger.error("request %s: its grammar failed to compile: %s", request.request_id,
                     grammar.error)
        self.waiting.popleft()
        request.status = RequestStatus.FINISHED_ERROR
        self._free_finished(request)
        self._grammar_failures.append(EngineCoreOutput(
            request_id=request.request_id, new_token_ids=[], finish_reason=FinishReason.ERROR))
        return False

    def get_grammar_output(self, scheduler_output: SchedulerOutput) -> GrammarOutput:
        """The token bitmask of the step's grammar-constrained rows (empty without any)."""
        return self.structured_outputs.grammar_output(scheduler_output, self.requests)

    def _preempt(self, request: Request) -> None:
        """Recompute-mode preemption: drop all KV, start over from the front of the queue."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # Tokens of steps in flight are dropped when they arrive; resuming recomputes them.
        request.num_output_placeholders = 0
        request.num_draft_tokens = request.num_scheduled_drafts = 0  # the runner's are gone
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Victims are taken newest first, so pushing each to the front keeps arrival order.
        self.waiting.appendleft(request)

    # -- results --------------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop checks, free finished requests.

        Returns one output per request that got tokens or finished, in batch order, plus one
        (without tokens) per prefill chunk that computed prompt logprobs. Logprobs travel with
        their tokens: a dropped token's are dropped too.
        """
        req_ids = model_runner_output.req_ids
        sampled = dict(zip(req_ids, model_runner_output.sampled_token_ids))
        # Only when some row asked for logprobs / prompt logprobs.
        logprobs = (None if model_runner_output.logprobs is None
                    else dict(zip(req_ids, model_runner_output.logprobs)))
        prompt_logprobs = model_runner_output.prompt_logprobs
        pooled = model_runner_output.pooled  # a pooling runner's finishing prompts
        # Rows whose logits held a NaN: the request ends with "error", its token unseen.
        failed = model_runner_output.nan_req_ids  # almost always empty
        drafts = model_runner_output.draft_token_ids  # None: no drafts proposed
        if drafts is not None:
            drafts = dict(zip(req_ids, zip(drafts, model_runner_output.draft_pauses.tolist())))
        outputs, self._grammar_failures = self._grammar_failures, []
        finished: set[str] = set()
        requests, running_status = self.requests, RequestStatus.RUNNING
        for req_id in scheduler_output.req_ids:
            request = requests.get(req_id)
            token_ids = sampled.get(req_id)
            # Aborted/finished since scheduling (not in `requests`) or preempted: drop, with
            # its logprobs (an async step past a stop samples a token nobody sees).
            if request is None or request.status != running_status:
                continue
            prompt_chunk = None if prompt_logprobs is None else prompt_logprobs.get(req_id)
            if not token_ids:
                if prompt_chunk is not None:  # a prefill chunk: its prompt logprobs only
                    outputs.append(EngineCoreOutput(request_id=req_id, new_token_ids=[],
                                                    new_prompt_logprobs=prompt_chunk))
                continue
            if request.num_output_placeholders:
                request.num_output_placeholders = max(
                    0, request.num_output_placeholders - len(token_ids))
            if request.num_scheduled_drafts:  # a verify step: the KV of rejected drafts goes
                accepted = len(token_ids) - 1
                request.num_computed_tokens -= request.num_scheduled_drafts - accepted
                self.spec_stats.record(request.num_scheduled_drafts, accepted)
                request.num_scheduled_drafts = 0
            if failed and req_id in failed:
                logger.error("request %s: NaN in its logits; finished with an error", req_id)
                request.status = RequestStatus.FINISHED_ERROR
                finished.add(req_id)
                self._free_finished(request)
                outputs.append(EngineCoreOutput(request_id=req_id, new_token_ids=[],
                                                finish_reason=FinishReason.ERROR))
                continue
            kept = 0
            for token_id in token_ids:
                request.append_output_token_ids(token_id)
                kept += 1
                if request.check_stop(self.max_model_len):
                    break  # tokens past a stop are dropped
            if drafts is not None:  # after its tokens, which its grammar has accepted
                request.take_drafts(*drafts[req_id])
            # Usually every token is kept (one per step): the list itself, not a copy.
            new_token_ids = token_ids if kept == len(token_ids) else token_ids[:kept]
            if request.status != running_status:
                finished.add(req_id)
                self._free_finished(request)
            new_logprobs = None
            if logprobs is not None and (sample_logprobs := logprobs.get(req_id)) is not None:
                new_logprobs = sample_logprobs[:kept]  # one per token, as new_token_ids
            outputs.append(EngineCoreOutput(
                request_id=req_id, new_token_ids=new_token_ids,
                finish_reason=request.status.finish_reason, stop_reason=request.stop_reason,
                new_logprobs=new_logprobs, new_prompt_logprobs=prompt_chunk,
                num_cached_tokens=request.num_cached_tokens,
                pooled=None if pooled is None else pooled.get(req_id)))
        if finished:
            self.running = [r for r in self.running if r.request_id not in finished]
        return outputs
