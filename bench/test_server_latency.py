"""Online serving latency (issue 8): TTFT, TPOT and ITL of a real `mrv2 serve`, next to the same
requests sent to the in-process AsyncLLM without HTTP, in the same run.

Server side: `mrv2 serve` on the demo model (float32) on 127.0.0.1, a free port
(`ServerProcess`, the server tests' helper), driven by `mrv2 bench serve`'s own client
(`run_benchmark`: streaming `/v1/completions`, random token-id prompts, every request exactly
`output_len` tokens, all sent at once with at most `max_concurrency` in flight).
pytest-benchmark times the whole workload's wall time.

Baseline: an `AsyncLLM` in this process, the engine the server runs underneath (built from
the server's own command line, so the configuration is the same: core process, async
scheduling, prefix caching), given the same prompts with the same concurrency and DELTA
outputs (what the completions route asks for). It is timed exactly as the HTTP client times
the server: a "chunk" is an output carrying text, TTFT is send -> first chunk, ITL the gaps
between chunks, TPOT (latency - TTFT) / (tokens - 1), all through `compute_metrics`. What the
server adds on top is the HTTP and OpenAI layer: request parsing and validation, SSE
encoding, uvicorn, the client's SSE parsing (a third busy process on 2 cores). The ratios
`server_over_engine_ttft_p50` / `_tpot_p50` / `_itl_p50` (server median / engine median:
how many times slower through HTTP) show it.

After two warm-up rounds (not recorded), each round runs the baseline (untimed setup, timed
by hand) and then the server workload, so both see the same machine state; the server sits
idle while the engine runs and the other way round (an idle server costs no CPU). Each round
draws new prompts (seed + round) so neither side's prefix cache turns later rounds into cache
hits; both sides get the same prompts in a round. The metrics pool all measured rounds'
requests. On 2 cores the client, the front end and the engine core compete for CPU: check
/proc/loadavg (recorded) first.

When this was written (2-core CPU VM, shared, load ~1.4; 32 prompts, 64 in / 32 out,
concurrency 8, 5 rounds), two runs gave server / engine medians of TTFT 35-38 / 22 ms, TPOT
2.3-2.5 / 1.7-1.8 ms, ITL 2.3-2.4 / 1.7 ms: `server_over_engine_ttft_p50` 1.56-1.71,
`_tpot_p50` 1.29-1.46. With one warm-up round instead of two, the server's p99 TTFT was
~260 ms: full GC passes (generation 2) of the server and core processes, up to 250 ms each
while their heaps are young (nothing calls `gc.freeze()` after startup, as vLLM does).

Under `--benchmark-disable` (CI) the workload shrinks to a few prompts and tokens; startup of
the server and the engine is most of its cost. Nothing asserts a speed; the case checks that
every request got all its tokens and that the server, the engine cores and their sockets and
shared memory are gone afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

from mrv2.engine.arg_utils import EngineArgs
from mrv2.engine.async_llm import AsyncLLM
from mrv2.entrypoints.bench.dataset import random_token_prompts
from mrv2.entrypoints.bench.serve import run_benchmark
from mrv2.entrypoints.bench.serve_client import ChunkClock, RequestResult
from mrv2.entrypoints.bench.serve_metrics import compute_metrics
from mrv2.entrypoints.cli import build_parser
from mrv2.entrypoints.openai.cli_args import (ServerConfig, engine_args_from, resolve_model,
                                              server_config_from)
from mrv2.entrypoints.openai.generation_config import default_sampling_params
from mrv2.entrypoints.openai.protocol import CompletionRequest
from mrv2.outputs import RequestOutputKind
from mrv2.sampling_params import SamplingParams
from mrv2.testing import ServerProcess, default_demo_model_path
from mrv2.testing.leftovers import lasting_engine_entries

ROUNDS = 5
WARMUP_ROUNDS = 2
MODEL_NAME = "demo"
MAX_MODEL_LEN = 256
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
               "--served-model-name", MODEL_NAME, "--uvicorn-log-level", "warning"]
METRICS = ("ttft", "tpot", "itl")


@dataclasses.dataclass(frozen=True)
class ServingWorkload:
    num_prompts: int = 32
    input_len: int = 64
    output_len: int = 32
    max_concurrency: int = 8
    seed: int = 0

    def reduced(self) -> "ServingWorkload":
        """The CI size: still several requests in flight at once, a few seconds in all."""
        return dataclasses.replace(self, num_prompts=4, input_len=8, output_len=4,
                                   max_concurrency=2)

    def prompts(self, round_index: int, vocab_size: int) -> list[list[int]]:
        return random_token_prompts(self.num_prompts, self.input_len, vocab_size,
                                    self.seed + round_index)


def serve_config(model: str, server_args: Sequence[str]) -> tuple[EngineArgs, ServerConfig]:
    """What `mrv2 serve MODEL SERVER_ARGS` builds its AsyncLLM and its routes from."""
    args = build_parser().parse_args(["serve", model, *server_args])
    model = resolve_model(args)
    return engine_args_from(args, model), server_config_from(args, model)


def route_sampling_params(config: ServerConfig, max_tokens: int) -> SamplingParams:
    """The SamplingParams the completions route builds from `stream_completion`'s request
    body (greedy, ignore_eos, with the server's --generation-config defaults)."""
    request = CompletionRequest(model=MODEL_NAME, prompt=[0], max_tokens=max_tokens,
                                temperature=0.0, ignore_eos=True, stream=True)
    defaults = default_sampling_params(config.model, config.generation_config)
    return request.to_sampling_params(max_tokens, defaults)


async def engine_completion(engine: AsyncLLM, prompt: list[int], params: SamplingParams,
                            request_id: str) -> RequestResult:
    """`stream_completion`'s timing, over `AsyncLLM.generate` instead of HTTP. Unlike the
    HTTP client it raises on failure: a broken baseline must fail the case."""
    result = RequestResult(prompt_len=len(prompt))
    clock = ChunkClock(result)
    tokens = 0
    async for output in engine.generate({"prompt_token_ids": prompt}, params, request_id,
                                        RequestOutputKind.DELTA):
        completion = output.outputs[0]
        tokens += len(completion.token_ids)
        if not completion.text:
            continue  # the HTTP client skips these chunks too (partial character held back)
        clock.content_chunk()
    clock.finish()
    result.output_tokens = tokens
    result.success = clock.chunks > 0
    return result


async def run_engine_benchmark(engine: AsyncLLM, prompts: list[list[int]],
                               params: SamplingParams, max_concurrency: int, id_prefix: str
                               ) -> tuple[list[RequestResult], float]:
    """`run_benchmark` with the request rate at inf, against the engine; (results, seconds)."""
    semaphore = asyncio.Semaphore(max_concurrency)

    async def one(index: int, prompt: list[int]) -> RequestResult:
        async with semaphore:
            return await engine_completion(engine, prompt, params, f"{id_prefix}-{index}")

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return list(results), time.perf_counter() - start


def _checked_metrics(results: list[RequestResult], duration: float,
                     workload: ServingWorkload) -> dict[str, Any]:
    metrics = compute_metrics(results, duration)
    assert metrics["failed"] == 0, metrics["errors"]
    assert metrics["total_output_tokens"] == len(results) * workload.output_len
    return metrics


def test_server_latency(benchmark) -> None:
    workload = ServingWorkload()
    if benchmark.disabled:
        workload = workload.reduced()
    benchmark.group = "serving-latency"
    model = str(default_demo_model_path())
    engine_args, server_config = serve_config(model, SERVER_ARGS)
    params = route_sampling_params(server_config, workload.output_len)
    shm_before = set(os.listdir("/dev/shm"))
    engine_runs: list[tuple[list[RequestResult], float]] = []
    server_runs: list[tuple[list[RequestResult], float]] = []
    # One event loop for the AsyncLLM: its client's reader task lives on the loop it first
    # ran on. (Each server round gets its own loop, as `mrv2 bench serve` does.) The engine is
    # built while the server starts: the two startups are most of the CI cost.
    with asyncio.Runner() as runner, ServerProcess(model, SERVER_ARGS, wait=False) as server:
        engine = AsyncLLM.from_engine_args(engine_args)
        engine_core, ipc_dir = engine.engine_core.proc, engine.engine_core.ipc_dir
        try:
            server.wait_ready()
            server_core = server.core_pid()
            vocab_size = min(engine.config.model_config.vocab_size, len(engine.tokenizer))
            rounds = itertools.count(WARMUP_ROUNDS)

            def run_engine(round_index: int) -> None:
                prompts = workload.prompts(round_index, vocab_size)
                engine_runs.append(runner.run(run_engine_benchmark(
                    engine, prompts, params, workload.max_concurrency, f"bench-{round_index}")))

            def run_server(round_index: int) -> None:
                prompts = workload.prompts(round_index, vocab_size)
                results, duration, _ = asyncio.run(run_benchmark(
                    server.url, MODEL_NAME, prompts, workload.output_len, float("inf"),
                    workload.max_concurrency, workload.seed))
                server_runs.append((results, duration))

            def setup() -> tuple[tuple[int], dict]:
                round_index = next(rounds)
                run_engine(round_index)
                return (round_index,), {}

            # Warm-up rounds, not recorded: first calls into numba and oneDNN, the
            # detokenizer, the HTTP stack, and the processes' first full (generation 2) GC
            # passes, which stop a process for 100-250 ms each while its heap (torch,
            # fastapi) is still young; after two rounds they are rare.
            for round_index in range(WARMUP_ROUNDS):
                run_engine(round_index)
                run_server(round_index)
            engine_runs.clear()
            server_runs.clear()
            benchmark.pedantic(run_server, setup=setup, rounds=ROUNDS, warmup_rounds=0)
        finally:
            runner.run(_stop_engine(engine))
    # Everything is gone: both engine cores, the server, their socket dirs, shared memory.
    assert not engine_core.is_alive() and not os.path.exists(ipc_dir)
    assert server.proc.poll() is not None and server.leftovers == []
    assert not os.path.exists(f"/proc/{server_core}")
    assert not lasting_engine_entries(shm_before, semaphores=False)
    benchmark.extra_info.update(_latency_info(workload, server_runs, engine_runs))


def _latency_info(workload: ServingWorkload,
                  server_runs: list[tuple[list[RequestResult], float]],
                  engine_runs: list[tuple[list[RequestResult], float]]) -> dict[str, Any]:
    server = _checked_metrics(*_pooled(server_runs), workload)
    engine = _checked_metrics(*_pooled(engine_runs), workload)
    last_round = WARMUP_ROUNDS + len(server_runs) - 1
    info: dict[str, Any] = dict(
        dataclasses.asdict(workload), request_rate="inf", rounds=len(server_runs),
        warmup_rounds=WARMUP_ROUNDS,
        prompt_seeds=f"seed + {WARMUP_ROUNDS} .. seed + {last_round}", model="demo-llama",
        server_args=" ".join(SERVER_ARGS),
        loadavg_1m=float(open("/proc/loadavg").read().split()[0]), cpus=os.cpu_count())
    for side, metrics in (("server", server), ("engine", engine)):
        for name in METRICS:
            for stat in ("mean", "median", "p99"):
                info[f"{side}_{stat}_{name}_ms"] = metrics[f"{stat}_{name}_ms"]
        info[f"{side}_output_tokens_per_s"] = metrics["output_throughput"]
    for name in METRICS:
        info[f"server_over_engine_{name}_p50"] = (server[f"median_{name}_ms"]
                                                  / engine[f"median_{name}_ms"])
    info["server_over_engine_duration"] = server["duration"] / engine["duration"]
    return info


def _pooled(runs: list[tuple[list[RequestResult], float]]) -> tuple[list[RequestResult], float]:
    """Every round's requests, and the rounds' total wall time (throughputs stay per second)."""
    return [r for results, _ in runs for r in results], sum(d for _, d in runs)


async def _stop_engine(engine: AsyncLLM) -> None:
    # On the engine's loop, so that its output handler is cancelled there (leaving the
    # Runner then finishes every task left on it).
    engine.shutdown()
