"""`mrv2 bench serve`: latency and throughput of any OpenAI-compatible server, through streaming
`/v1/completions`, printed in vLLM's layout (TTFT, TPOT, ITL: mean / median / p99 in ms).

Per request: TTFT = first content chunk - send; ITL = gaps between later content chunks;
TPOT = (latency - TTFT) / (output tokens - 1). The output token count is the server's
`usage.completion_tokens` when it reports it (stream_options.include_usage), else the number
of content chunks. Requests arrive all at once (`--request-rate inf`) or as a Poisson process
with that rate (seeded), at most `--max-concurrency` in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

from mrv2.entrypoints.bench.dataset import random_token_prompts
from mrv2.entrypoints.bench.serve_client import RequestResult, first_model, stream_completion
from mrv2.entrypoints.bench.serve_metrics import compute_metrics, format_report


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server root (the /v1 routes are below it)")
    parser.add_argument("--model", default=None,
                        help="model name to request (default: the first of /v1/models)")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals (inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=1000,
                        help="random prompt ids are drawn from [10, vocab-size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None, help="write the results here")


async def run_benchmark(base_url: str, model: str | None, prompts: list[list[int]],
                        output_len: int, request_rate: float, max_concurrency: int | None,
                        seed: int = 0) -> tuple[list[RequestResult], float, str]:
    """Send every prompt; returns (results, wall seconds, model name)."""
    import httpx

    base_url = base_url.rstrip("/")
    timeout = httpx.Timeout(None, connect=30.0)
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts) or 1)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        if model is None:
            model = await first_model(client, base_url)
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        rng = np.random.default_rng(seed)

        async def one(prompt: list[int]) -> RequestResult:
            if semaphore is None:
                return await stream_completion(client, base_url, model, prompt, output_len)
            async with semaphore:
                return await stream_completion(client, base_url, model, prompt, output_len)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start, model


def run_serve_bench(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    prompts = random_token_prompts(args.num_prompts, args.random_input_len, args.vocab_size,
                                   args.seed)
    results, duration, model = asyncio.run(run_benchmark(
        args.base_url, args.model, prompts, args.random_output_len, args.request_rate,
        args.max_concurrency, args.seed))
    metrics = compute_metrics(results, duration)
    print(format_report(metrics, args.request_rate, args.max_concurrency))
    if args.output_json:
        metrics.update(model=model, base_url=args.base_url, num_prompts=args.num_prompts,
                       request_rate=str(args.request_rate), max_concurrency=args.max_concurrency,
                       random_input_len=args.random_input_len,
                       random_output_len=args.random_output_len, seed=args.seed)
        with open(args.output_json, "w") as f:
            json.dump(metrics, f, indent=2)
    return 0 if metrics["completed"] else 1
