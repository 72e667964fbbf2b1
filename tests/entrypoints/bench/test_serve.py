"""`mrv2 bench serve` against a fake OpenAI streaming server started in the test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_openai_server import FakeOpenAIServer  # noqa: E402

from mrv2.entrypoints.bench.serve_client import RequestResult  # noqa: E402
from mrv2.entrypoints.bench.serve_metrics import compute_metrics  # noqa: E402
from mrv2.entrypoints.cli import main  # noqa: E402


@pytest.mark.parametrize("extra", [[], ["--request-rate", "200", "--max-concurrency", "2"]])
def test_bench_serve_reports_latencies(tmp_path, capsys, extra):
    out_json = tmp_path / "serve.json"
    with FakeOpenAIServer(delay_s=0.003) as server:
        code = main(["bench", "serve", "--base-url", server.base_url, "--num-prompts", "5",
                     "--random-input-len", "7", "--random-output-len", "6",
                     "--output-json", str(out_json), *extra])
        requests = list(server.requests)
    out = capsys.readouterr().out
    assert code == 0
    for label in ("Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):",
                  "Median TPOT (ms):", "P99 TPOT (ms):", "Mean ITL (ms):", "Median ITL (ms):",
                  "P99 ITL (ms):", "Request throughput (req/s):",
                  "Output token throughput (tok/s):"):
        assert label in out
    result = json.loads(out_json.read_text())
    assert result["completed"] == 5 and result["failed"] == 0
    assert result["total_output_tokens"] == 30 and result["total_input_tokens"] == 35
    assert result["model"] == "fake-model"  # the first of /v1/models
    # Tokens arrive ~3 ms apart; loose bounds, the machine may be busy.
    assert 2.0 <= result["median_itl_ms"] < 200 and 2.0 <= result["median_tpot_ms"] < 200
    assert result["median_ttft_ms"] >= 2.0
    assert len(requests) == 5
    assert all(r["stream"] and r["max_tokens"] == 6 and len(r["prompt"]) == 7 for r in requests)


def test_bench_serve_counts_failures(capsys):
    with FakeOpenAIServer() as server:
        # A wrong root: every request gets a 404, counted as failed, and the command says so.
        code = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{server.port}/bad",
                     "--model", "m", "--num-prompts", "2", "--random-output-len", "2"])
    out = capsys.readouterr().out
    assert code == 1
    assert "Failed requests:" in out and "HTTP 404" in out


def test_metrics_from_known_timings():
    results = [RequestResult(success=True, prompt_len=4, output_tokens=3, ttft=0.1,
                             latency=0.5, itl=[0.2, 0.2]),
               RequestResult(success=True, prompt_len=4, output_tokens=1, ttft=0.3,
                             latency=0.3, itl=[])]
    m = compute_metrics(results, duration=2.0)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(200.0)  # (0.5 - 0.1) / 2; the 1-token one has none
    assert m["median_itl_ms"] == pytest.approx(200.0)
