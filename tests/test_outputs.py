"""RequestOutput / CompletionOutput: vLLM's field names and defaults."""

from __future__ import annotations

from mrv2.outputs import CompletionOutput, RequestOutput


def test_completion_output_finished():
    running = CompletionOutput(index=0, text="ab", token_ids=[1, 2])
    assert not running.finished()
    assert running.finish_reason is None and running.stop_reason is None
    assert running.cumulative_logprob is None and running.logprobs is None
    for reason in ("stop", "length", "abort"):
        assert CompletionOutput(index=0, text="", token_ids=[], finish_reason=reason).finished()


def test_request_output_defaults_are_not_shared():
    completion = CompletionOutput(index=0, text="x", token_ids=[7], finish_reason="length")
    a = RequestOutput(request_id="a", prompt="p", prompt_token_ids=[1], outputs=[completion],
                      finished=True)
    b = RequestOutput(request_id="b", prompt=None, prompt_token_ids=[2], outputs=[],
                      finished=False)
    assert a.prompt_logprobs is None
    # Outside the engine: no stats and no cache hit (vLLM's defaults).
    assert a.metrics is None and b.num_cached_tokens == 0
    assert a.outputs[0].token_ids == [7] and a.finished and not b.finished


def test_request_output_kind_values_match_vllm():
    from mrv2.outputs import RequestOutputKind

    assert [(k.name, int(k)) for k in RequestOutputKind] == [
        ("CUMULATIVE", 0), ("DELTA", 1), ("FINAL_ONLY", 2)]


def test_request_state_stats_fields_match_vllm():
    import dataclasses

    from mrv2.outputs import RequestStateStats

    stats = RequestStateStats()
    # vLLM v1's RequestStateStats fields that mrv2 tracks, with vLLM's zero defaults.
    assert [f.name for f in dataclasses.fields(stats)] == [
        "num_generation_tokens", "arrival_time", "queued_ts", "scheduled_ts", "first_token_ts",
        "last_token_ts", "first_token_latency"]
    assert all(getattr(stats, f.name) == 0 for f in dataclasses.fields(stats))


def test_metric_types_match_vllm_reader():
    from mrv2.outputs import Counter, Gauge, Histogram, Metric, Vector

    counter = Counter(name="vllm:x", labels={"engine": "0"}, value=3)
    gauge = Gauge(name="vllm:y", labels={}, value=0.5)
    hist = Histogram(name="vllm:z", labels={}, count=2, sum=1.5, buckets={"1.0": 1, "+Inf": 2})
    vector = Vector(name="vllm:v", labels={}, values=[1, 2])
    assert all(isinstance(m, Metric) for m in (counter, gauge, hist, vector))
    assert counter.value == 3 and gauge.value == 0.5 and hist.buckets["+Inf"] == hist.count
