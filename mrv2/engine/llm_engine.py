"""LLMEngine: tokenizer + input processing + engine core + output processing, in-process.

A request with `n > 1` fans out into n core requests `f"{i}_{request_id}"` sharing the prompt,
each with params `n=1` and seed `seed + i` (unseeded stays unseeded, so the samples differ);
the output processor gathers them back into one RequestOutput. Requests that the output
processor finishes on a stop string are aborted in the core at once, freeing their KV blocks;
their runner slots are freed by the core's next step.

The engine core runs in this process (`InprocClient`, the offline default) or, with
`multiprocess_core=True`, in its own process (`MPClient`): the core then steps on its own while
this process tokenizes and detokenizes. `engine_core` is the in-process EngineCore (None with a
core process); `core_client` is the client either way. With a core process a request the core
refuses raises `RequestRejectedError` from `step()` rather than from `add_request()`.

vLLM's surface beyond the step loop: `max_logprobs` (EngineArgs; at most mrv2's MAX_LOGPROBS)
caps the (prompt) logprobs a request may ask for, -1 meaning the whole vocabulary;
`get_metrics()` (vLLM's reader types), `reset_prefix_cache()` and `collective_rpc()`.
"""

from __future__ import annotations

import bisect
import time
from typing import Any, Callable

import msgspec

from mrv2.core.engine_core import EngineCore
from mrv2.engine.arg_utils import EngineArgs
from mrv2.engine.client import InprocClient, MPClient, RequestRejectedError
from mrv2.engine.input_processor import InputProcessor, PromptType
from mrv2.engine.output_processor import OutputProcessor
from mrv2.errors import ConfigError
from mrv2.models.tokenizer import load_tokenizer
from mrv2.outputs import (Counter, Gauge, Histogram, Metric, RequestOutput, RequestOutputKind,
                          RequestStateStats, Vector)
from mrv2.pooling_params import PoolingParams
from mrv2.protocol import CoreStats, EngineCoreRequest
from mrv2.sampling_params import MAX_LOGPROBS, SamplingParams

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


def child_sampling_params(params: SamplingParams) -> list[SamplingParams]:
    """Params of the n samples of one request: n=1 each, seeds seed+i when seeded."""
    if params.seed is None:
        child = params.clone(n=1)
        return [child] * params.n
    return [params.clone(n=1, seed=params.seed + i) for i in range(params.n)]


def core_requests(request: EngineCoreRequest, core_ids: list[str],
                  children: list[SamplingParams] | None,
                  output_kind: RequestOutputKind) -> list[EngineCoreRequest]:
    """What the core receives for one user request: itself, or one request per sample of
    n > 1 (ids `core_ids`, params `children`), each with the `output_kind` the caller reads
    (the scheduler runs several decode steps at once for FINAL_ONLY: core/decode_steps.py)."""
    if children is None:
        ids, params = [request.request_id], [request.sampling_params]
    else:
        ids, params = core_ids, children
    return [msgspec.structs.replace(request, request_id=core_id, sampling_params=(
                p if p.output_kind == output_kind else p.clone(output_kind=output_kind)))
            for core_id, p in zip(ids, params)]


def user_request_id(output_processor: OutputProcessor, core_request_id: str) -> str:
    """The user's request id of a core request (its parent's, for a sample of n > 1)."""
    state = output_processor.requests.get(core_request_id)
    if state is not None and state.parent is not None:
        return state.parent.request_id
    return core_request_id


def token_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's build_1_2_5_buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class HistogramState:
    """Observations counted per bucket (upper limits `bounds`, then +Inf)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def metric(self, name: str, labels: dict[str, str]) -> Histogram:
        buckets, total = {}, 0
        for bound, count in zip((*map(str, map(float, self.bounds)), "+Inf"), self.counts):
            total += count
            buckets[bound] = total
        return Histogram(name=name, labels=dict(labels), count=total, sum=self.sum,
                         buckets=buckets)


class EngineMetrics:
    """The counters of `LLMEngine.get_metrics()` that the core does not keep, since the engine
    started: tokens (prompt tokens of accepted core requests, generated tokens as the core
    reports them), finished core requests by reason, and per finished request its time to first
    token, end-to-end latency (from arrival), prompt and generation lengths."""

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.labels = {"model_name": model_name, "engine": "0"}
        self.prompt_tokens = self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        lengths = token_buckets(max_model_len)
        self.histograms = {"vllm:time_to_first_token_seconds": HistogramState(LATENCY_BUCKETS_S),
                           "vllm:e2e_request_latency_seconds": HistogramState(LATENCY_BUCKETS_S),
                           "vllm:request_prompt_tokens": HistogramState(lengths),
                           "vllm:request_generation_tokens": HistogramState(lengths)}

    def on_finished(self, stats: RequestStateStats, finish_reason: str,
                    num_prompt_tokens: int) -> None:
        self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1
        h = self.histograms
        if stats.num_generation_tokens:
            h["vllm:time_to_first_token_seconds"].observe(stats.first_token_latency)
        h["vllm:e2e_request_latency_seconds"].observe(time.time() - stats.arrival_time)
        h["vllm:request_prompt_tokens"].observe(num_prompt_tokens)
        h["vllm:request_generation_tokens"].observe(stats.num_generation_tokens)

    def snapshot(self, core: CoreStats) -> list[Metric]:
        labels = self.labels
        metrics: list[Metric] = [
            Gauge("vllm:num_requests_running", dict(labels), core.num_running),
            Gauge("vllm:num_requests_waiting", dict(labels), core.num_waiting),
            Gauge("vllm:kv_cache_usage_perc", dict(labels), core.kv_cache_usage),
            Counter("vllm:prefix_cache_queries", dict(labels), core.prefix_cache_queries),
            Counter("vllm:prefix_cache_hits", dict(labels), core.prefix_cache_hits),
            Counter("vllm:num_preemptions", dict(labels), core.num_preemptions),
            Counter("vllm:prompt_tokens", dict(labels), self.prompt_tokens),
            Counter("vllm:generation_tokens", dict(labels), self.generation_tokens)]
        metrics += [Counter("vllm:request_success", {**labels, "finished_reason": reason}, count)
                    for reason, count in self.finished.items()]
        metrics += [h.metric(name, labels) for name, h in self.histograms.items()]
        if core.spec_decode:  # SpecDecodeStats.totals
            drafts, draft_tokens, accepted, *per_pos = core.spec_decode
            metrics += [Counter("vllm:spec_decode_num_drafts", dict(labels), drafts),
                        Counter("vllm:spec_decode_num_draft_tokens", dict(labels), draft_tokens),
                        Counter("vllm:spec_decode_num_accepted_tokens", dict(labels), accepted),
                        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels),
                               per_pos)]
        return metrics


class LLMEngine:
    def __init__(self, engine_args: EngineArgs, multiprocess_core: bool = False) -> None:
        self.config = engine_args.create_engine_config()
        self.max_logprobs = engine_args.max_logprobs
        dp = self.config.parallel_config.data_parallel_size
        if dp > 1:
            raise ConfigError(f"data_parallel_size={dp}: the offline LLM / LLMEngine runs one "
                              f"engine core; data parallelism is the server's (mrv2 serve -dp, "
                              f"AsyncLLM)")
        if multiprocess_core:
            # Started first: the tokenizer loads while the core process starts.
            self.core_client = MPClient(self.config)
            self.engine_core: EngineCore | None = None
        else:
            self.core_client = InprocClient(self.config)
            self.engine_core = self.core_client.engine_core
        try:
            self.tokenizer = load_tokenizer(self.config.model_config.tokenizer_path)
        except BaseException:
            self.core_client.shutdown()
            raise
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        model_config = self.config.model_config
        self.metrics = EngineMetrics(model_config.model, model_config.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer, self.metrics.on_finished)

    def validate_request(self, request_id: str, prompt: PromptType,
                         params: SamplingParams | PoolingParams):
        """All checks of `add_request` without adding anything."""
        return self.input_processor.process(request_id, prompt, self._check_logprobs(params))

    def _check_logprobs(self, params: SamplingParams | PoolingParams
                        ) -> SamplingParams | PoolingParams:
        """vLLM's max_logprobs check; -1 asks for the whole vocabulary (then the params with
        the vocabulary size in its place, were it ever within the cap). PoolingParams are
        resolved against the engine instead (InputProcessor.resolve_pooling)."""
        if isinstance(params, PoolingParams):
            return self.input_processor.resolve_pooling(params)
        vocab_size = self.config.model_config.vocab_size
        changes = {}
        for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            value = getattr(params, name)
            if not isinstance(value, int) or isinstance(value, bool):
                continue  # None, or a bad type the input processor names
            wanted = vocab_size if value == -1 else value
            if wanted > self.max_logprobs:
                whole = " (-1: the whole vocabulary)" if value == -1 else ""
                raise ValueError(
                    f"SamplingParams.{name}={value}{whole} is invalid: requested {what} logprobs "
                    f"of {wanted}, which is greater than max allowed: {self.max_logprobs} "
                    f"(max_logprobs): must be in [0, {self.max_logprobs}] (mrv2 returns at most "
                    f"{MAX_LOGPROBS})")
            if value == -1:
                changes[name] = wanted
        return params.clone(**changes) if changes else params

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | PoolingParams,
                    output_kind: RequestOutputKind | None = None) -> None:
        """Queue a request. Its RequestOutputs come from `step()`, streamed per `output_kind`;
        None: `params.output_kind` when it is DELTA or FINAL_ONLY, and FINAL_ONLY for its
        default (CUMULATIVE), this step loop's documented default: pass CUMULATIVE here for
        cumulative updates.

        On any error nothing of the request stays behind, in the front end or in the core.
        """
        params = self._check_logprobs(params)
        pooling = params if isinstance(params, PoolingParams) else None
        request, text = self.input_processor.process(request_id, prompt, params)
        params = request.sampling_params  # a pooling request's are the engine's one-token ones
        if output_kind is None:
            output_kind = params.output_kind
            if output_kind == RequestOutputKind.CUMULATIVE:
                output_kind = RequestOutputKind.FINAL_ONLY
        children = child_sampling_params(params) if params.n > 1 else None
        core_ids = self.output_processor.add_request(
            request_id, text, request.prompt_token_ids, params, output_kind, children,
            arrival_time=request.arrival_time, pooling=pooling)
        added: list[str] = []
        try:
            for core_request in core_requests(request, core_ids, children, output_kind):
                self.core_client.add_request(core_request)
                added.append(core_request.request_id)
                self.metrics.prompt_tokens += len(request.prompt_token_ids)
        except BaseException:
            self.output_processor.abort_requests([request_id])
            if added and not self.core_client.is_dead:
                self.core_client.abort_requests(added)
            raise

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests (a parent id aborts all its samples): frees their blocks at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.core_client.abort_requests(self.output_processor.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """In process: run one core step. With a core process: wait for its next outputs
        (without waiting when no request is unfinished)."""
        timeout = None if self.output_processor.has_unfinished_requests() else 0
        try:
            outputs = self.core_client.get_output(timeout)
        except RequestRejectedError as error:
            self.abort_request([user_request_id(self.output_processor, error.request_id)])
            raise
        self.metrics.generation_tokens += sum(len(o.new_token_ids) for o in outputs.outputs)
        processed = self.output_processor.process_outputs(outputs.outputs, outputs.timestamp)
        if processed.reqs_to_abort:
            self.core_client.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def drain(self) -> None:
        """In process: run the few empty steps that free the runner slots of finished and
        aborted requests and retire steps in flight, now rather than at the next call. A core
        process does this on its own."""
        core = self.engine_core
        if core is None:
            return
        for _ in range(2 + core.max_steps_in_flight):
            if not core.has_unfinished_requests():
                break
            self.step()

    def get_stats(self):
        """The core's scheduler stats (mrv2.protocol.CoreStats)."""
        return self.core_client.get_stats()

    def get_metrics(self) -> list[Metric]:
        """vLLM's `get_metrics()`: the core's gauges and counters now, and this engine's token
        counters, finished requests and latency histograms (EngineMetrics)."""
        return self.metrics.snapshot(self.get_stats())

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (nothing done) while a request holds blocks."""
        return bool(self.core_client.call_utility("reset_prefix_cache"))

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode: level 1 frees the KV cache, level 2 the weights too (EngineCore);
        the engine must be idle."""
        self.core_client.call_utility("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo sleep() (EngineCore.wake_up)."""
        self.core_client.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return bool(self.core_client.call_utility("is_sleeping"))

    def collective_rpc(self, method: str | Callable, timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """`method(*args, **kwargs)` on every worker (a callable runs as
        `method(worker, *args, **kwargs)`); one result per worker, rank order. Needs the
        engine core in this process: the core process has no such utility."""
        if self.engine_core is None:
            raise NotImplementedError("collective_rpc needs the engine core in this process "
                                      "(multiprocess_core=False)")
        return self.engine_core.collective_rpc(method, timeout, args, kwargs)

    def shutdown(self) -> None:
        self.core_client.shutdown()
