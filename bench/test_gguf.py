"""GGUF checkpoints: load time against the same model as safetensors, and SmolLM2-135M offline
throughput next to transformers' `generate`, both engines on the built-in Q4_1 GGUF (float32
after dequantization), in the same run.

`test_gguf_load_vs_safetensors`: `LLM(gguf)` construction (timed by pytest-benchmark) against
`LLM(twin)` (timed by hand in the untimed setup, same engine arguments, a small KV budget so
the allocation does not dominate), the twin being the GGUF saved as float32 safetensors by
transformers (bench/gguf_workload.py). `open_gguf`'s parse is lru-cached per process, so every
round clears it first: each GGUF load parses the file. The setup also times `open_gguf` alone
(metadata and tensor records, no weights; under `--benchmark-disable` the GGUF load then reuses
that parse, sparing CI a second one). extra_info: `gguf_median_s`,
`safetensors_median_s`, `gguf_over_safetensors` (the GGUF's extra load cost, lower is
better), `open_median_s` and `open_share_of_gguf_load` (what part of the GGUF load the parse
is).

`test_smollm2_offline_vs_hf[1|32]`: 1 or 32 random-id prompts of 128 tokens (e2e_workload's
prompts, fixed seed), 128 greedy tokens with EOS ignored, prefix caching off; transformers
runs its GGUF load of the same file (float32) with e2e_workload.HFRunner. As in
test_e2e_offline: HF in the setup (timed by hand), mrv2 timed, `mrv2_over_hf` = median HF
seconds / median mrv2 seconds (higher is better), each engine's `*_output_tokens_per_s`, and
the roofline limit of SmolLM2's shapes (`limit_s`, `mrv2_over_limit`, `hf_over_limit`).
`greedy_match` is the fraction of prompts whose tokens agree in full (a real model, unlike the
seeded e2e ones, can hit near-ties; the first token must agree).

Under `--benchmark-disable` (CI) the model stays SmolLM2 (a GGUF has no smaller variant) but
the throughput cases shrink to 2 prompts of 16 tokens and 4 output tokens, transformers loads
the twin (the same float32 weights, bit for bit, in well under a second instead of its slow
GGUF path) and every case runs once, without warm-up. One mrv2 LLM and one transformers model
serve both throughput cases.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import pytest
import torch

from e2e_workload import HFRunner, Mrv2Runner, set_threads, throughput_info
from gguf_workload import (gguf_path, load_hf_dir, load_hf_gguf, max_model_len, safetensors_twin,
                           smollm2_workload)
from roofline import machine_rates, workload_limit

ROUNDS = 3
LOAD_KV_CACHE_GB = 0.05  # SmolLM2 at 272 tokens: 18 blocks of 0.7 MiB needed, 72 fit
BATCHES = (1, 32)


class Engines:
    """One mrv2 LLM (room for the largest batch) and one transformers model for the module,
    built on first use (the load case needs neither), shut down at the module's end."""

    def __init__(self) -> None:
        self._llm: Any = None
        self._hf: torch.nn.Module | None = None

    def mrv2(self, reduced: bool) -> Any:
        if self._llm is None:
            from mrv2 import LLM

            w = smollm2_workload(max(BATCHES), reduced)
            self._llm = LLM(str(gguf_path()), dtype="float32", max_model_len=max_model_len(w),
                            max_num_seqs=w.num_prompts, seed=0, enable_prefix_caching=False)
        return self._llm

    def hf(self, reduced: bool) -> torch.nn.Module:
        if self._hf is None:
            self._hf = load_hf_dir(safetensors_twin()) if reduced else load_hf_gguf()
        return self._hf

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
        self._llm = self._hf = None


@pytest.fixture(scope="module")
def engines():
    e = Engines()
    yield e
    e.shutdown()


def _clear_gguf_cache() -> None:
    from mrv2.models.gguf.checkpoint import _open_cached

    _open_cached.cache_clear()
    gc.collect()  # the dropped checkpoint's memory maps, and any shut-down LLM's weights


def test_gguf_load_vs_safetensors(benchmark):
    from mrv2 import LLM
    from mrv2.models.gguf import open_gguf

    benchmark.group = "gguf-load"
    path = gguf_path()
    twin = safetensors_twin()  # built (once, cached on disk) before anything is timed
    reduced = benchmark.disabled
    kwargs = dict(dtype="float32", max_model_len=max_model_len(smollm2_workload(1, reduced)),
                  kv_cache_memory_gb=LOAD_KV_CACHE_GB, seed=0, enable_prefix_caching=False)
    built: list[Any] = []  # the timed GGUF LLMs, shut down outside the timing

    def load(model: object) -> float:
        _clear_gguf_cache()
        start = time.perf_counter()
        llm = LLM(str(model), **kwargs)
        elapsed = time.perf_counter() - start
        llm.shutdown()
        return elapsed

    def open_only() -> float:
        _clear_gguf_cache()
        start = time.perf_counter()
        checkpoint = open_gguf(path)
        elapsed = time.perf_counter() - start
        assert checkpoint.tensors
        return elapsed

    def shutdown_built() -> None:
        while built:
            built.pop().shutdown()

    if not reduced:
        load(twin), load(path)  # warm-up: imports, first kernel calls, both files paged in
    open_seconds: list[float] = []
    safetensors_seconds: list[float] = []
    gguf_seconds: list[float] = []

    def setup():
        shutdown_built()
        safetensors_seconds.append(load(twin))
        open_seconds.append(open_only())
        if not reduced:  # timed: the GGUF load parses the file. CI: spare a second parse.
            _clear_gguf_cache()
        return (), {}

    def load_gguf() -> None:
        start = time.perf_counter()
        built.append(LLM(str(path), **kwargs))
        gguf_seconds.append(time.perf_counter() - start)

    try:
        benchmark.pedantic(load_gguf, setup=setup, rounds=ROUNDS, warmup_rounds=0)
    finally:
        shutdown_built()
    # Left parsed: the throughput cases' LLM reuses the parse, as any second load would.
    stats = getattr(benchmark, "stats", None)
    gguf_median = stats.stats.median if stats is not None else statistics.median(gguf_seconds)
    st_median = statistics.median(safetensors_seconds)
    open_median = statistics.median(open_seconds)
    benchmark.extra_info.update(
        gguf_median_s=gguf_median, safetensors_median_s=st_median,
        gguf_over_safetensors=gguf_median / st_median, open_median_s=open_median,
        open_share_of_gguf_load=open_median / gguf_median, rounds=ROUNDS,
        gguf_file=path.name, gguf_bytes=path.stat().st_size,
        safetensors_bytes=sum(f.stat().st_size for f in twin.glob("*.safetensors")),
        max_model_len=kwargs["max_model_len"], kv_cache_memory_gb=LOAD_KV_CACHE_GB)


def test_read_gguf_file_vs_gguf_reader(benchmark):
    """Opening the built-in file: mrv2's reader (timed) against `gguf.GGUFReader` (timed by
    hand in the setup; skipped under --benchmark-disable, where it would add ~5 s to CI for no
    check) on the same file in the same run. extra_info: both medians and
    `gguf_reader_over_mrv2` (higher is better)."""
    from mrv2.models.gguf.reader import read_gguf_file

    benchmark.group = "gguf-open"
    path = gguf_path()
    reader_seconds: list[float] = []

    def setup():
        if not benchmark.disabled:
            import gguf

            start = time.perf_counter()
            gguf.GGUFReader(path)
            reader_seconds.append(time.perf_counter() - start)
        return (), {}

    result = benchmark.pedantic(lambda: read_gguf_file(path), setup=setup, rounds=ROUNDS,
                                warmup_rounds=0)
    assert len(result.tensors) == 272 and len(result.fields["tokenizer.ggml.tokens"]) == 49152
    stats = getattr(benchmark, "stats", None)
    if stats is not None:
        reader_median = statistics.median(reader_seconds)
        benchmark.extra_info.update(mrv2_median_s=stats.stats.median,
                                    gguf_reader_median_s=reader_median,
                                    gguf_reader_over_mrv2=reader_median / stats.stats.median)


@pytest.mark.parametrize("batch", BATCHES)
def test_smollm2_offline_vs_hf(benchmark, engines, batch):
    w = smollm2_workload(batch, reduced=benchmark.disabled)
    # Right before the case (the bandwidth drifts within minutes); the engines may exist.
    rates = machine_rates(quick=benchmark.disabled)
    benchmark.group = f"gguf-e2e-{w.name}"
    mrv2 = Mrv2Runner(w, llm=engines.mrv2(benchmark.disabled))
    hf = HFRunner(w, model=engines.hf(benchmark.disabled))
    set_threads()
    if not benchmark.disabled:
        mrv2.run(), hf.run()  # warm-up: first calls at these shapes
    hf_seconds: list[float] = []

    def setup():
        hf_seconds.append(hf.run())
        return (), {}

    last_seconds = benchmark.pedantic(mrv2.run, setup=setup, rounds=ROUNDS, warmup_rounds=0)
    # The last round's tokens, the same prompts through both engines.
    assert [t[0] for t in mrv2.last_token_ids] == [t[0] for t in hf.last_token_ids]
    agree = sum(a == b for a, b in zip(mrv2.last_token_ids, hf.last_token_ids))
    greedy_match = agree / w.num_prompts
    hf_median = statistics.median(hf_seconds)
    stats = getattr(benchmark, "stats", None)
    mrv2_median = stats.stats.median if stats is not None else last_seconds
    out_tokens = w.num_prompts * w.output_len
    benchmark.extra_info.update(throughput_info(w, mrv2_median))
    benchmark.extra_info.update(
        model=gguf_path().name, hf_median_s=hf_median, mrv2_median_s=mrv2_median,
        mrv2_output_tokens_per_s=out_tokens / mrv2_median,
        hf_output_tokens_per_s=out_tokens / hf_median, mrv2_over_hf=hf_median / mrv2_median,
        greedy_match=greedy_match, rounds=ROUNDS)
    limit = workload_limit(w, rates)
    benchmark.extra_info.update(limit_s=limit.limit_s, limit_decode_bound=limit.decode_bound,
                                mrv2_over_limit=limit.limit_s / mrv2_median,
                                hf_over_limit=limit.limit_s / hf_median,
                                gemm_gflop_per_s=rates.gemm_flops_per_s / 1e9,
                                read_gb_per_s=rates.read_bytes_per_s / 1e9)
