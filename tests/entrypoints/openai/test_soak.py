"""The soak mix against the shared server: every request kind answers as it should, the
engine ends with nothing running, and resident memory stays flat once the mix is warm
(bench/soak.py runs the same mix for thousands of requests on the built-in model)."""

from __future__ import annotations

import time

from mrv2.testing.soak import REQUEST_KINDS, run_soak

from .conftest import MODEL_NAME

ROUNDS = 40  # of the mix: 320 requests


def test_soak_answers_every_kind_and_holds_memory_flat(server):
    processes = {"api": server.proc.pid, "core": server.core_pid()}
    n = ROUNDS * len(REQUEST_KINDS)
    result = run_soak(server.url, MODEL_NAME, n, processes=processes, concurrency=8,
                      sample_every=40, headers=server.headers())
    outcomes = {kind: {o for k, o in result.outcomes if k == kind} for kind in REQUEST_KINDS}
    assert outcomes["completion"] == outcomes["chat_json_schema"] == {"ok"}
    assert outcomes["bad_request"] == {"rejected"}
    assert outcomes["chat_stream_disconnect"] == {"disconnected"}
    assert sum(result.outcomes.values()) == n
    # The engine lets go of every request, the disconnected ones too.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if metrics["vllm:num_requests_running"] == metrics["vllm:num_requests_waiting"] == 0:
            break
        time.sleep(0.1)
    assert metrics["vllm:num_requests_running"] == metrics["vllm:num_requests_waiting"] == 0
    assert metrics["vllm:kv_cache_usage_perc"] == 0
    # Growth over the second half (the first warms what request shapes warm: compiled
    # grammars, oneDNN primitives of each padded row count, allocator pools).
    for name in processes:
        assert result.growth(name, after=n // 2) < 0.03, (name, result.samples)
    assert "Exception in ASGI" not in server.log_text()
