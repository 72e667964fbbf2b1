"""Prometheus metrics for `GET /metrics` under vLLM's names (`vllm:` prefix, `model_name`
label), so dashboards, autoscalers and routers built for vLLM read them unchanged; a figure vLLM
does not publish keeps an `mrv2:` name (`mrv2:prefix_cache_hit_rate`).

Scheduler state (running / waiting requests, KV-cache usage, prefix-cache queries and hits,
preemptions) is read from the engine core at scrape time. Token counters and the latency
histograms (time to first token, time per output token, end to end) are measured here, in the
API process, per engine request; an aborted request counts its tokens but not its latencies.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mrv2.protocol import CoreStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5)


class _EngineCollector(Collector):
    """The latest CoreStats snapshot of each engine core as gauges and counters, labelled by
    the core's data-parallel index (`engine`, as vLLM labels them); nothing before the first."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: list[CoreStats] | None = None

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator:
        if not self.stats:
            return
        names = ["model_name", "engine"]
        engines = [([self.model_name, str(i)], stats) for i, stats in enumerate(self.stats)]
        gauges = (
            ("vllm:num_requests_running", "Requests in the running batch.",
             lambda s: s.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
             lambda s: s.num_waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
             lambda s: s.kv_cache_usage),
            ("mrv2:prefix_cache_hit_rate", "Prefix-cache hits / queries, in tokens.",
             lambda s: s.prefix_cache_hits / s.prefix_cache_queries
             if s.prefix_cache_queries else 0.0))
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=names)
            for labels, stats in engines:
                gauge.add_metric(labels, value(stats))
            yield gauge
        for name, doc, value in (
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 lambda s: s.prefix_cache_queries),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 lambda s: s.prefix_cache_hits),
                ("num_preemptions", "Requests preempted.", lambda s: s.num_preemptions)):
            counter = CounterMetricFamily(f"vllm:{name}", doc, labels=names)
            for labels, stats in engines:
                counter.add_metric(labels, value(stats))
            yield counter
        spec = [(labels, stats.spec_decode) for labels, stats in engines if stats.spec_decode]
        if spec:  # SpecDecodeStats.totals
            yield from _spec_decode_counters(spec, names)


def _spec_decode_counters(engines: list[tuple[list[str], list[int]]], names: list[str]
                          ) -> Iterator:
    """vLLM's speculative-decoding counters (each engine's SpecDecodeStats.totals); accepted
    drafts per position labelled by it."""
    for column, (name, doc) in enumerate((
            ("num_drafts", "Verify steps of a request with drafts."),
            ("num_draft_tokens", "Draft tokens verified."),
            ("num_accepted_tokens", "Draft tokens accepted."))):
        counter = CounterMetricFamily(f"vllm:spec_decode_{name}", doc, labels=names)
        for labels, totals in engines:
            counter.add_metric(labels, totals[column])
        yield counter
    counter = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted at each position.",
                                  labels=[*names, "position"])
    for labels, totals in engines:
        for position, value in enumerate(totals[3:]):
            counter.add_metric([*labels, str(position)], value)
    yield counter


class RequestTimer:
    """Token counts and latencies of one engine request."""

    def __init__(self, metrics: "ServerMetrics", num_prompt_tokens: int) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first_token: float | None = None
        self.num_generated = 0
        metrics.prompt_tokens.labels(metrics.model_name).inc(num_prompt_tokens)

    def on_tokens(self, num_new: int) -> None:
        if num_new <= 0:
            return
        if self.first_token is None:
            self.first_token = time.perf_counter()
            self.metrics.ttft.labels(self.metrics.model_name).observe(
                self.first_token - self.start)
        self.num_generated += num_new
        self.metrics.generation_tokens.labels(self.metrics.model_name).inc(num_new)

    def on_completion_finished(self, finish_reason: str | None) -> None:
        self.metrics.request_success.labels(self.metrics.model_name, str(finish_reason)).inc()

    def on_request_finished(self, aborted: bool) -> None:
        if aborted:
            return
        metrics, name = self.metrics, self.metrics.model_name
        now = time.perf_counter()
        metrics.e2e.labels(name).observe(now - self.start)
        if self.first_token is not None and self.num_generated > 1:
            metrics.tpot.labels(name).observe(
                (now - self.first_token) / (self.num_generated - 1))


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        registry, labels = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of accepted requests.",
                                     labels, registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", labels,
                                         registry=registry)
        self.request_success = Counter("vllm:request_success",
                                       "Finished completions (samples) by reason.",
                                       ["model_name", "finished_reason"], registry=registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to the first token.",
                              labels, buckets=_LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Time per output token after the first.", labels,
                              buckets=_TPOT_BUCKETS, registry=registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             labels, buckets=_LATENCY_BUCKETS, registry=registry)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot,
                       self.e2e):
            metric.labels(model_name)  # exported (at zero) before the first request
        self._engine = _EngineCollector(model_name)
        registry.register(self._engine)

    def request_timer(self, num_prompt_tokens: int) -> RequestTimer:
        return RequestTimer(self, num_prompt_tokens)

    def render(self, stats: list[CoreStats] | None) -> bytes:
        """The exposition text, with each engine core's `stats` (by data-parallel index); None
        (the engine did not answer) leaves the engines' metrics out."""
        self._engine.stats = stats
        return generate_latest(self.registry)
