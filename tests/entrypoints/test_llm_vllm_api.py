"""vLLM's offline surface beyond generate: SamplingParams sentinels (seed=-1, logprobs=-1),
output_kind, max_logprobs, RequestOutput.num_cached_tokens / metrics, LLM.reset_prefix_cache,
get_default_sampling_params, get_metrics and collective_rpc. One LLM for the whole module."""

from __future__ import annotations

import time

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.config import ConfigError
from mrv2.engine.arg_utils import EngineArgs
from mrv2.outputs import Counter, Gauge, Histogram, RequestOutputKind, RequestStateStats
from mrv2.sampling_params import MAX_LOGPROBS

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=256, max_num_seqs=8)
    yield llm
    llm.shutdown()


def greedy(max_tokens=4, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def ids_prompt(start: int, length: int = 40) -> dict:
    """A token-id prompt no other test uses (so its cache hits are this test's own)."""
    return {"prompt_token_ids": [start + i for i in range(length)]}


def run_one(llm: LLM, prompt, params=None):
    [out] = llm.generate(prompt, params or greedy(), use_tqdm=False)
    return out


# -- 1. SamplingParams: output_kind, logprobs=-1, max_logprobs ---------------------------------


def test_generate_returns_final_outputs_whatever_the_output_kind(llm):
    prompt = ids_prompt(300)
    want = run_one(llm, prompt, greedy(6))
    for kind in RequestOutputKind:
        params = greedy(6, output_kind=kind)
        got = run_one(llm, prompt, params)
        assert got.finished and got.outputs[0].token_ids == want.outputs[0].token_ids
        assert params.output_kind is kind  # the caller's params are not changed


def stream(llm: LLM, request_id: str, params: SamplingParams, output_kind=None) -> list:
    engine = llm.llm_engine
    engine.add_request(request_id, ids_prompt(400, 8), params, output_kind)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    engine.drain()
    return outputs


def test_llm_engine_honours_params_output_kind(llm):
    delta = stream(llm, "delta", greedy(4, output_kind=RequestOutputKind.DELTA))
    assert [len(o.outputs[0].token_ids) for o in delta] == [1, 1, 1, 1]
    final = stream(llm, "final", greedy(4, output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(final) == 1 and final[0].finished
    assert sum((o.outputs[0].token_ids for o in delta), []) == final[0].outputs[0].token_ids
    # The default (CUMULATIVE) keeps LLMEngine's step loop at FINAL_ONLY; the argument wins.
    assert len(stream(llm, "default", greedy(4))) == 1
    cumulative = stream(llm, "cum", greedy(4), RequestOutputKind.CUMULATIVE)
    assert [len(o.outputs[0].token_ids) for o in cumulative] == [1, 2, 3, 4]


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_whole_vocabulary_logprobs_exceed_max_logprobs(llm, field):
    vocab = llm.llm_engine.config.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"{field}=-1.*of {vocab}, which is greater than max "
                                         rf"allowed: {MAX_LOGPROBS}"):
        llm.generate(ids_prompt(500), greedy(**{field: -1}), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_max_logprobs_lowers_the_cap(llm, monkeypatch):
    monkeypatch.setattr(llm.llm_engine, "max_logprobs", 2)
    with pytest.raises(ValueError, match=r"logprobs=3 .*max allowed: 2"):
        llm.generate(ids_prompt(500), greedy(logprobs=3), use_tqdm=False)
    out = run_one(llm, ids_prompt(500), greedy(2, logprobs=2))
    assert all(len(entry) >= 2 for entry in out.outputs[0].logprobs)


def test_max_logprobs_engine_arg(tiny_llama):
    assert EngineArgs(model=str(tiny_llama), max_logprobs=5).max_logprobs == 5
    EngineArgs(model=str(tiny_llama), max_logprobs=5).create_engine_config()
    for value in (MAX_LOGPROBS + 1, -1):  # checked before any weight is read
        with pytest.raises(ConfigError, match=rf"max_logprobs={value}.*at most {MAX_LOGPROBS}"):
            LLM(str(tiny_llama), max_model_len=256, max_logprobs=value)


# -- 2. RequestOutput.num_cached_tokens and metrics --------------------------------------------


def test_num_cached_tokens_and_reset_prefix_cache(llm):
    prompt = ids_prompt(600)  # 40 tokens: two full blocks can hit, never the last token
    assert llm.reset_prefix_cache()
    first = run_one(llm, prompt)
    assert first.num_cached_tokens == 0
    second = run_one(llm, prompt)
    assert second.num_cached_tokens == 2 * BLOCK_SIZE
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.reset_prefix_cache()
    assert run_one(llm, prompt).num_cached_tokens == 0
    # n > 1: every sample shares the prompt, which is cached by now.
    assert run_one(llm, prompt, greedy(n=2)).num_cached_tokens == 2 * BLOCK_SIZE


def test_reset_prefix_cache_refused_while_a_request_holds_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("holder", ids_prompt(700), greedy(50))
    engine.step()
    assert llm.reset_prefix_cache() is False
    engine.abort_request(["holder"])
    engine.drain()
    assert llm.reset_prefix_cache() is True


def test_request_metrics(llm):
    before = time.time()
    out = run_one(llm, ids_prompt(800), greedy(5))
    stats = out.metrics
    assert isinstance(stats, RequestStateStats)
    assert stats.num_generation_tokens == len(out.outputs[0].token_ids) == 5
    assert before <= stats.arrival_time <= time.time()
    assert 0 < stats.queued_ts <= stats.first_token_ts < stats.last_token_ts <= time.monotonic()
    assert 0 < stats.first_token_latency <= time.time() - stats.arrival_time
    assert stats.scheduled_ts == 0.0  # not reported by the core
    [parent] = llm.generate(ids_prompt(800), greedy(3, n=2), use_tqdm=False)
    assert parent.metrics.num_generation_tokens == 3


# -- 3. get_default_sampling_params, get_metrics, collective_rpc --------------------------------


def test_get_default_sampling_params(llm):
    params = llm.get_default_sampling_params()
    assert isinstance(params, SamplingParams)
    assert params == SamplingParams(**llm._sampling_defaults)
    assert params is not llm.get_default_sampling_params()


def metric_values(llm: LLM) -> dict:
    values = {}
    for metric in llm.get_metrics():
        assert metric.name.startswith("vllm:") and metric.labels["engine"] == "0"
        key = (metric.name, metric.labels.get("finished_reason"))
        assert key not in values
        values[key] = metric
    return values


def test_get_metrics(llm):
    before = metric_values(llm)
    prompt = ids_prompt(900, 20)
    run_one(llm, prompt, greedy(7))
    after = metric_values(llm)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        assert isinstance(after[name, None], Gauge) and after[name, None].value == 0

    def grew(name, reason=None):
        assert isinstance(after[name, reason], Counter)
        return after[name, reason].value - before[name, reason].value

    assert grew("vllm:prompt_tokens") == 20 and grew("vllm:generation_tokens") == 7
    assert grew("vllm:request_success", "length") == 1
    assert grew("vllm:request_success", "stop") == 0
    assert grew("vllm:prefix_cache_queries") == 20 and grew("vllm:prefix_cache_hits") == 0
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        hist = after[name, None]
        assert isinstance(hist, Histogram)
        assert hist.count == before[name, None].count + 1 == hist.buckets["+Inf"]
        assert list(hist.buckets.values()) == sorted(hist.buckets.values())  # cumulative
    lengths = after["vllm:request_generation_tokens", None]
    assert lengths.buckets["5.0"] == before["vllm:request_generation_tokens", None].buckets["5.0"]
    assert lengths.buckets["10.0"] == before["vllm:request_generation_tokens", None].buckets[
        "10.0"] + 1
    assert lengths.sum == before["vllm:request_generation_tokens", None].sum + 7


def worker_rank(worker, offset=0, *, scale=1):
    return (worker.rank + offset) * scale


def test_collective_rpc(llm, monkeypatch):
    assert llm.collective_rpc(worker_rank) == [0]
    assert llm.collective_rpc(worker_rank, args=(3,), kwargs={"scale": 2}) == [6]
    worker = llm.llm_engine.engine_core.executor.worker
    monkeypatch.setattr(worker, "echo", lambda *args, **kwargs: (args, kwargs), raising=False)
    assert llm.collective_rpc("echo", args=(1, 2)) == [((1, 2), {})]
    assert llm.collective_rpc("echo", kwargs={"a": 1}) == [((), {"a": 1})]
    for method in ("_private", "no_such_method"):
        with pytest.raises(AttributeError):
            llm.collective_rpc(method)
    with pytest.raises(AttributeError, match="private"):
        llm.collective_rpc("_private", kwargs={"a": 1})
