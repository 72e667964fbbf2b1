"""`/metrics`: Prometheus text that prometheus_client parses, the engine's gauges, the API
process's counters and histograms, and disconnected clients leaving nothing running."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mrv2.entrypoints.openai.metrics import ServerMetrics
from mrv2.protocol import CoreStats

from .conftest import API_KEY, MODEL_NAME, SERVER_ARGS, RemoteServer

STATS = CoreStats(num_running=3, num_waiting=2, num_unfinished=5, has_unfinished=True,
                  kv_cache_usage=0.25, num_free_blocks=30, num_kv_blocks=40, num_preemptions=1,
                  prefix_cache_queries=100, prefix_cache_hits=40)


def _samples(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if "le" not in s.labels and "finished_reason" not in s.labels}


def test_render_parses_and_carries_engine_and_request_metrics():
    metrics = ServerMetrics("m")
    timer = metrics.request_timer(num_prompt_tokens=7)
    timer.on_tokens(1)
    timer.on_tokens(3)
    timer.on_completion_finished("length")
    timer.on_request_finished(aborted=False)
    aborted = metrics.request_timer(num_prompt_tokens=2)
    aborted.on_request_finished(aborted=True)
    values = _samples(metrics.render([STATS]).decode())
    assert values["vllm:num_requests_running"] == 3
    assert values["vllm:num_requests_waiting"] == 2
    assert values["vllm:kv_cache_usage_perc"] == 0.25
    assert values["vllm:prefix_cache_queries_total"] == 100
    assert values["vllm:prefix_cache_hits_total"] == 40
    assert values["mrv2:prefix_cache_hit_rate"] == 0.4
    assert values["vllm:num_preemptions_total"] == 1
    assert values["vllm:prompt_tokens_total"] == 9
    assert values["vllm:generation_tokens_total"] == 4
    assert values["vllm:time_to_first_token_seconds_count"] == 1
    assert values["vllm:time_per_output_token_seconds_count"] == 1
    assert values["vllm:e2e_request_latency_seconds_count"] == 1  # the aborted one is not
    # Without engine stats (a dead engine) the API-side metrics remain.
    without = _samples(metrics.render(None).decode())
    assert "vllm:num_requests_running" not in without
    assert without["vllm:prompt_tokens_total"] == 9


def test_spec_decode_counters_as_vllm_names_them():
    import msgspec

    stats = msgspec.structs.replace(STATS, spec_decode=[4, 12, 7, 4, 2, 1])
    families = {f.name: f for f in text_string_to_metric_families(
        ServerMetrics("m").render([stats]).decode())}
    values = _samples(ServerMetrics("m").render([stats]).decode())
    assert values["vllm:spec_decode_num_drafts_total"] == 4
    assert values["vllm:spec_decode_num_draft_tokens_total"] == 12
    assert values["vllm:spec_decode_num_accepted_tokens_total"] == 7
    per_pos = {s.labels["position"]: s.value
               for s in families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
               if s.name.endswith("_total")}
    assert per_pos == {"0": 4, "1": 2, "2": 1}
    assert "vllm:spec_decode_num_drafts_total" not in _samples(
        ServerMetrics("m").render([STATS]).decode())


def test_each_engine_core_has_its_own_series_labelled_by_its_index():
    import msgspec

    other = msgspec.structs.replace(STATS, num_running=1, kv_cache_usage=0.5,
                                    spec_decode=[1, 2, 1, 1])
    families = {f.name: f for f in text_string_to_metric_families(
        ServerMetrics("m").render([STATS, other]).decode())}
    running = {s.labels["engine"]: s.value
               for s in families["vllm:num_requests_running"].samples}
    assert running == {"0": 3, "1": 1}
    assert {s.labels["engine"]: s.value for s in families["vllm:kv_cache_usage_perc"].samples} \
        == {"0": 0.25, "1": 0.5}
    assert all(s.labels["model_name"] == "m" for s in families["vllm:num_requests_running"]
               .samples)
    drafts = [s for s in families["vllm:spec_decode_num_drafts"].samples
              if s.name.endswith("_total")]
    assert [(s.labels["engine"], s.value) for s in drafts] == [("1", 1)]  # only it drafts


def test_server_metrics_count_a_request(server, client):
    before = server.metrics()
    out = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=5,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    after = server.metrics()
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == \
        out.usage.prompt_tokens
    assert after["vllm:e2e_request_latency_seconds_count"] == \
        before["vllm:e2e_request_latency_seconds_count"] + 1
    assert after["vllm:time_to_first_token_seconds_count"] == \
        before["vllm:time_to_first_token_seconds_count"] + 1
    assert after["vllm:time_per_output_token_seconds_count"] == \
        before["vllm:time_per_output_token_seconds_count"] + 1
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "mrv2:prefix_cache_hit_rate"):
        assert name in after


def _wait_idle(server, timeout_s: float = 15.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        values = server.metrics()
        idle = values["vllm:num_requests_running"] == 0 and \
            values["vllm:num_requests_waiting"] == 0 and values["vllm:kv_cache_usage_perc"] == 0
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


# The disconnect test's server: a KV pool of this many blocks holds the 23 requests while
# they are aborted early (~1-4 blocks each), but not if they ran on to 450 tokens (29 blocks
# each): then the engine core must preempt. Run to the end, they would also finish within
# seconds on this tiny model and leave the pool empty, so "idle afterwards" alone would not
# prove that the core was told to abort; "no preemption" does.
POOL_BLOCKS = 400
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def small_pool_server(tiny_llama):
    config = json.loads((tiny_llama / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    block_bytes = 2 * config["num_hidden_layers"] * BLOCK_SIZE * \
        config["num_key_value_heads"] * head_dim * 4  # float32 on CPU
    remote = RemoteServer(tiny_llama, [*SERVER_ARGS, "--block-size", str(BLOCK_SIZE),
                                       "--kv-cache-memory-gb",
                                       repr(POOL_BLOCKS * block_bytes / 2**30)])
    yield remote
    remote.stop()


def test_disconnected_clients_are_aborted(small_pool_server):
    server = small_pool_server
    max_tokens = 450
    # 23 requests run to the end would need far more than the pool: the core would preempt.
    assert 23 * -(-(max_tokens + 8) // BLOCK_SIZE) > 1.5 * POOL_BLOCKS
    body = {"model": MODEL_NAME, "prompt": "once upon a time", "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    before = _wait_idle(server)

    async def leave_a_stream(http: httpx.AsyncClient, i: int) -> int:
        chunks = 0
        async with http.stream("POST", "/v1/completions", headers=headers,
                               json={**body, "prompt": f"{i} once upon a time",
                                     "stream": True}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                chunks += line.startswith("data: ")
                if chunks == 2:
                    break  # leaving the block closes the connection mid-generation
        return chunks

    async def leave_a_request(http: httpx.AsyncClient) -> None:
        try:
            await http.post("/v1/completions", headers=headers, json=body, timeout=0.1)
        except httpx.TimeoutException:
            return
        raise AssertionError("a 450-token request finished within 0.1 s")

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as http:
            streams = [leave_a_stream(http, i) for i in range(20)]
            plain = [leave_a_request(http) for _ in range(3)]
            return (await asyncio.gather(*streams, *plain))[:20]

    assert asyncio.run(main()) == [2] * 20
    after = _wait_idle(server)
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    # The core stopped them: they never grew enough to need a preemption.
    assert after["vllm:num_preemptions_total"] == before["vllm:num_preemptions_total"]
    # Aborted, not run to the end: far fewer tokens than 23 full requests.
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < 23 * max_tokens / 2, generated
