"""Front-end side of outputs: detokenize, apply stop strings, build RequestOutputs.

One `RequestOutputState` per engine-core request. A request with n > 1 is a `ParentRequest` whose n
children (core ids `f"{i}_{parent_id}"`) run as independent core requests; their outputs are
gathered into one RequestOutput per parent per step, `outputs` ordered by index:

- FINAL_ONLY: one RequestOutput when every child has finished, with all n completions.
- CUMULATIVE: every step, all n completions so far (empty for children with no output yet).
- DELTA: every step, the completions of the children that moved, each with only its new part.

A completion ended by a stop string is finished here, not in the core: `process_outputs`
returns its id in `reqs_to_abort`, and the caller must abort it in the engine core so its KV
blocks and runner slot are freed.

Logprobs (engine/request_logprobs.py) are accumulated only for requests that asked: a completion's
`logprobs` is always the slice of entries matching its `token_ids`. `prompt_logprobs` goes into
every RequestOutput, except with DELTA: the first only. Outputs that carry only a prefill
chunk's prompt logprobs (no token) are accumulated and produce no RequestOutput.

Every RequestOutput carries `num_cached_tokens` (the core's prefix-cache hit of the request's
first admission) and `metrics`, the request's live RequestStateStats (mrv2/outputs.py): token
count and timestamps, advanced here from each step's outputs and the core's step timestamp.
For n > 1 both are those of the sample whose output produced the RequestOutput (as vLLM's).
`on_finished`, when given, is called with (stats, finish reason, prompt length) once per core
request that finishes here (LLMEngine's counters for `get_metrics`).

A pooling request (added with `pooling=`, its resolved PoolingParams) produces one
PoolingRequestOutput, when it finishes: the core's pooled vector, normalised here when its
params say so. One the engine failed (no vector) gets `outputs.data` None.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mrv2.engine.detokenizer import make_detokenizer
from mrv2.engine.request_logprobs import RequestLogprobs, TokenTexts
from mrv2.engine.stop_checker import CompletionText
from mrv2.outputs import (CompletionOutput, PoolingOutput, PoolingRequestOutput, PromptLogprobs,
                          RequestOutput, RequestOutputKind, RequestStateStats, pooled_tensor)
from mrv2.pooling_params import PoolingParams
from mrv2.protocol import EngineCoreOutput, FinishReason
from mrv2.sampling_params import SamplingParams


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


@dataclass
class ParentRequest:
    """The user's request with n > 1: gathers its children's completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    child_ids: list[str]
    # Latest completion per index (CUMULATIVE, FINAL_ONLY).
    completions: list[CompletionOutput | None] = field(default_factory=list)
    unfinished: set[str] = field(default_factory=set)
    # The prompt logprobs of the first child that completed its prompt (all children share
    # the prompt); None until then, or when not asked for.
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False  # DELTA: sent once
    # Of the child that moved last (what its RequestOutput reports).
    num_cached_tokens: int = 0
    metrics: RequestStateStats | None = None

    def __post_init__(self) -> None:
        self.completions = [None] * len(self.child_ids)
        self.unfinished = set(self.child_ids)

    @property
    def finished(self) -> bool:
        return not self.unfinished


@dataclass
class RequestOutputState:
    request_id: str
    index: int
    parent: ParentRequest | None
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: RequestOutputKind
    text: CompletionText
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: RequestLogprobs | None = None  # None unless it asked for (prompt) logprobs
    stats: RequestStateStats = field(default_factory=RequestStateStats)
    num_cached_tokens: int = 0
    pooling: PoolingParams | None = None  # a pooling request's (resolved) params


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput | PoolingRequestOutput]
    # Finished here by a stop string while the core still runs them: abort them in the core.
    reqs_to_abort: list[str]


FinishedCallback = Callable[[RequestStateStats, str, int], None]


class OutputProcessor:
    def __init__(self, tokenizer, on_finished: FinishedCallback | None = None) -> None:
        self.tokenizer = tokenizer
        self.on_finished = on_finished
        self.requests: dict[str, RequestOutputState] = {}  # core request id -> state
        self.parents: dict[str, ParentRequest] = {}  # parent id -> parent (n > 1)
        self.token_texts = TokenTexts(tokenizer)  # decoded_token of logprobs entries

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams,
                    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
                    child_params: Sequence[SamplingParams] | None = None,
                    arrival_time: float | None = None,
                    pooling: PoolingParams | None = None) -> list[str]:
        """Register a request; with `child_params` (n > 1) one child per entry.
        `arrival_time`: wall-clock (the EngineCoreRequest's), default now. `pooling`: a
        pooling request's params (`params` are then the engine's one-token ones).

        Returns the core request ids to add to the engine core, in index order.
        """
        queued_ts = time.monotonic()
        if arrival_time is None:
            arrival_time = time.time()
        output_kind = RequestOutputKind(output_kind)
        if child_params is None:
            ids = [request_id]
        else:
            ids = [child_request_id(request_id, i) for i in range(len(child_params))]
        for rid in {request_id, *ids}:
            if rid in self.requests or rid in self.parents:
                raise ValueError(f"request id {rid!r} is already in use")
        parent = None
        if child_params is not None:
            parent = ParentRequest(request_id, prompt, prompt_token_ids, output_kind, ids)
            self.parents[request_id] = parent
        streaming = output_kind != RequestOutputKind.FINAL_ONLY
        for index, rid in enumerate(ids):
            p = params if child_params is None else child_params[index]
            detokenizer = make_detokenizer(self.tokenizer, prompt_token_ids, p)
            logprobs = None
            if RequestLogprobs.wanted(p.logprobs, p.prompt_logprobs):
                logprobs = RequestLogprobs(p.logprobs, p.prompt_logprobs, self.token_texts)
            self.requests[rid] = RequestOutputState(
                rid, index, parent, prompt, prompt_token_ids, p, output_kind,
                CompletionText(detokenizer, p, streaming), logprobs=logprobs,
                stats=RequestStateStats(arrival_time=arrival_time, queued_ts=queued_ts),
                pooling=pooling)
        return ids

    def abort_requests(self, request_ids: Sequence[str]) -> list[str]:
        """Forget requests (a parent id forgets all its children). Unknown ids are ignored.

        Returns the core request ids to abort in the engine core.
        """
        to_abort: list[str] = []
        for request_id in request_ids:
            parent = self.parents.pop(request_id, None)
            if parent is not None:
                for child_id in parent.child_ids:
                    if self.requests.pop(child_id, None) is not None:
                        to_abort.append(child_id)
                continue
            state = self.requests.pop(request_id, None)
            to_abort.append(request_id)
            if state is not None and state.parent is not None:  # a child aborted alone
                state.parent.unfinished.discard(request_id)
                if state.parent.finished:
                    self.parents.pop(state.parent.request_id, None)
        return to_abort

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, outputs: Sequence[EngineCoreOutput],
                        timestamp: float | None = None) -> OutputProcessorOutput:
        """`timestamp`: the core's (time.monotonic()) of the step; default now."""
        if timestamp is None:
            timestamp = time.monotonic()
        now = None  # wall clock, read once per call when a first token arrives
        results: list[RequestOutput | PoolingRequestOutput] = []
        reqs_to_abort: list[str] = []
        # Parents moved this step, in order of first appearance -> their new completions.
        moved: dict[str, tuple[ParentRequest, list[CompletionOutput]]] = {}
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:  # aborted or stopped by the front end while the core ran it
                continue
            logprobs = state.logprobs
            if logprobs is not None:
                logprobs.add_prompt(out.new_prompt_logprobs)
                if not out.new_token_ids and not out.finished:
                    continue  # a prefill chunk's prompt logprobs: nothing to show yet
                logprobs.add_sample(out.new_logprobs, len(out.new_token_ids))
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if out.new_token_ids:
                stats = state.stats
                if not stats.num_generation_tokens:
                    now = time.time() if now is None else now
                    stats.first_token_ts = timestamp
                    stats.first_token_latency = now - stats.arrival_time
                stats.num_generation_tokens += len(out.new_token_ids)
                stats.last_token_ts = timestamp
                state.num_cached_tokens = out.num_cached_tokens
            state.output_token_ids.extend(out.new_token_ids)
            stop_str = state.text.update(out.new_token_ids,
                                         stop_terminated=finish_reason == FinishReason.STOP,
                                         finished=out.finished)
            if stop_str is not None:
                finish_reason, stop_reason = FinishReason.STOP, stop_str
                if not out.finished:
                    reqs_to_abort.append(out.request_id)
            finished = finish_reason is not None
            if finished:
                del self.requests[out.request_id]
                if self.on_finished is not None:
                    self.on_finished(state.stats, str(finish_reason), len(state.prompt_token_ids))
            if state.pooling is not None:  # one output, when it finishes
                if finished:
                    results.append(_pooling_output(state, out))
                continue
            completion = self._make_completion(state, out.new_token_ids, finish_reason,
                                               stop_reason)
            parent = state.parent
            if parent is None:
                if completion is not None:
                    results.append(RequestOutput(
                        request_id=state.request_id, prompt=state.prompt,
                        prompt_token_ids=state.prompt_token_ids, outputs=[completion],
                        finished=finished,
                        prompt_logprobs=None if logprobs is None else logprobs.prompt_out(
                            state.output_kind == RequestOutputKind.DELTA),
                        metrics=state.stats, num_cached_tokens=state.num_cached_tokens))
                continue
            parent.metrics, parent.num_cached_tokens = state.stats, state.num_cached_tokens
            if finished:
                parent.unfinished.discard(state.request_id)
            if (parent.prompt_logprobs is None and logprobs is not None
                    and state.output_token_ids):  # its prompt logprobs are complete
                parent.prompt_logprobs = logprobs.prompt_logprobs
            entry = moved.setdefault(parent.request_id, (parent, []))
            if completion is not None:
                entry[1].append(completion)
        for parent, completions in moved.values():
            output = self._make_parent_output(parent, completions)
            if output is not None:
                results.append(output)
        return OutputProcessorOutput(results, reqs_to_abort)

    def _make_completion(self, state: RequestOutputState, new_token_ids: list[int],
                         finish_reason: FinishReason | None,
                         stop_reason: int | str | None) -> CompletionOutput | None:
        finished = finish_reason is not None
        kind = state.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        text = state.text.next_text(finished, delta)
        token_ids = list(new_token_ids) if delta else list(state.output_token_ids)
        logprobs = state.logprobs
        return CompletionOutput(
            index=state.index, text=text, token_ids=token_ids,
            cumulative_logprob=None if logprobs is None else logprobs.cumulative_logprob,
            logprobs=None if logprobs is None else logprobs.sample_out(delta, len(token_ids)),
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason if finished else None)

    def _make_parent_output(self, parent: ParentRequest,
                            completions: list[CompletionOutput]) -> RequestOutput | None:
        finished = parent.finished
        if finished:
            self.parents.pop(parent.request_id, None)
        if parent.output_kind == RequestOutputKind.DELTA:
            outputs = sorted(completions, key=lambda c: c.index)
        else:
            for completion in completions:
                parent.completions[completion.index] = completion
            if parent.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
                return None
            outputs = [c if c is not None else CompletionOutput(index=i, text="", token_ids=[])
                       for i, c in enumerate(parent.completions)]
        if not outputs:
            return None
        prompt_logprobs = parent.prompt_logprobs
        if parent.output_kind == RequestOutputKind.DELTA:
            if parent.prompt_logprobs_sent:
                prompt_logprobs = None
            parent.prompt_logprobs_sent |= prompt_logprobs is not None
        return RequestOutput(request_id=parent.request_id, prompt=parent.prompt,
                             prompt_token_ids=parent.prompt_token_ids, outputs=outputs,
                             finished=finished, prompt_logprobs=prompt_logprobs,
                             metrics=parent.metrics, num_cached_tokens=parent.num_cached_tokens)


def _pooling_output(state: RequestOutputState, out: EngineCoreOutput) -> PoolingRequestOutput:
    data = None if out.pooled is None else pooled_tensor(out.pooled, state.pooling.normalize)
    return PoolingRequestOutput(request_id=state.request_id, outputs=PoolingOutput(data),
                                prompt_token_ids=state.prompt_token_ids,
                                num_cached_tokens=out.num_cached_tokens, finished=True)
