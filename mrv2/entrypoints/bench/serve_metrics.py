"""Aggregate per-request timings into vLLM's serving metrics and its printed report."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mrv2.entrypoints.bench.serve_client import RequestResult


def _stats(name: str, values_s: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}


def compute_metrics(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    # TPOT excludes the first token; a one-token request has none.
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    metrics: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    metrics.update(_stats("ttft", [r.ttft for r in ok]))
    metrics.update(_stats("tpot", tpots))
    metrics.update(_stats("itl", [gap for r in ok for gap in r.itl]))
    metrics.update(_stats("e2el", [r.latency for r in ok]))
    return metrics


def format_report(m: dict[str, Any], request_rate: float,
                  max_concurrency: int | None) -> str:
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40}{value:<10{fmt}}")

    row("Request rate configured (RPS):", str(request_rate))
    row("Maximum request concurrency:", str(max_concurrency))
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Benchmark duration (s):", m["duration"], ".2f")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", m["output_throughput"], ".2f")
    row("Total token throughput (tok/s):", m["total_token_throughput"], ".2f")
    for key, title in (("ttft", "Time to First Token"),
                       ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency")):
        lines.append("{s:{c}^50}".format(s=f" {title} ", c="-"))
        row(f"Mean {key.upper()} (ms):", m[f"mean_{key}_ms"], ".2f")
        row(f"Median {key.upper()} (ms):", m[f"median_{key}_ms"], ".2f")
        row(f"P99 {key.upper()} (ms):", m[f"p99_{key}_ms"], ".2f")
    for error in m["errors"]:
        lines.append(f"error: {error}")
    lines.append("=" * 50)
    return "\n".join(lines)
