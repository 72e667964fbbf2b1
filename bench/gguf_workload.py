"""The built-in SmolLM2-135M-Instruct GGUF (Q4_1) for the GGUF benchmarks: the e2e workload of
its shapes, transformers' float32 load of the same file, and its safetensors twin.

The twin (mrv2/testing/gguf_twin.py) is the GGUF as transformers dequantizes it, saved as
float32 safetensors: mrv2 loading the twin and the GGUF builds the same float32 model from the
same file, one through the safetensors path, one dequantizing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from e2e_workload import Workload, set_threads

OUTPUT_LEN = 128
INPUT_LEN = 128

# SmolLM2-135M's shapes (llama: 30 layers, hidden 576, 9 heads of 64, 3 KV heads, tied head).
SMOLLM2 = Workload("SmolLM2-135M", hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                   intermediate_size=1536, vocab_size=49152, num_prompts=1, input_len=INPUT_LEN,
                   output_len=OUTPUT_LEN)


def smollm2_workload(batch: int, reduced: bool = False) -> Workload:
    """`batch` prompts of INPUT_LEN random ids, OUTPUT_LEN tokens each; `reduced` (CI) keeps
    the real model (a GGUF has no smaller variant) and shrinks the batch and token counts."""
    w = replace(SMOLLM2, name=f"SmolLM2-b{batch}", num_prompts=batch)
    if reduced:
        w = replace(w, name=w.name + "-reduced", num_prompts=min(batch, 2), input_len=16,
                    output_len=4)
    return w


def max_model_len(w: Workload) -> int:
    """As e2e_workload.Mrv2Runner sizes it."""
    return w.input_len + w.output_len + 16


def gguf_path() -> Path:
    from mrv2.models.builtin import builtin_model_path

    return builtin_model_path()


def load_hf_gguf(path: Path | None = None) -> torch.nn.Module:
    """transformers' float32 model of the GGUF file (dequantized at load), eval mode."""
    from mrv2.testing.gguf_twin import load_hf_gguf as load

    set_threads()
    return load(path or gguf_path())


def load_hf_dir(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    set_threads()
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def safetensors_twin(path: Path | None = None,
                     hf_model: torch.nn.Module | None = None) -> Path:
    """The GGUF's safetensors twin (mrv2/testing/gguf_twin.py), built on first use."""
    from mrv2.testing.gguf_twin import safetensors_twin as twin

    return twin(path or gguf_path(), hf_model)


def token_id_prompts(batch: int, length: int) -> list[dict]:
    """`batch` prompts of `length` fixed pseudo-random token ids each (every row the same
    length, none of SmolLM2's special tokens)."""
    return [{"prompt_token_ids": [(i * 7919 + t * 104729) % 49000 + 100 for t in range(length)]}
            for i in range(batch)]


def greedy_timer(llm, prompts) -> Callable[[int], float]:
    """generate(n): seconds for `llm` to generate n greedy tokens (EOS ignored) for `prompts`."""
    from mrv2 import SamplingParams

    def generate(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    return generate


def decode_tokens_per_s(benchmark, generate: Callable[[int], float], tokens: int, batch: int,
                        rounds: int) -> float:
    """Timed rounds of `generate(tokens)` then `generate(1)` (each returns its seconds): the
    decode rate without the prefill, (tokens - 1) * batch / (median round - 2 * median
    1-token call)."""
    ones: list[float] = []

    def round_() -> None:
        generate(tokens)
        ones.append(generate(1))

    benchmark.pedantic(round_, rounds=rounds, iterations=1)
    decode_s = benchmark.stats.stats.median - 2 * statistics.median(ones)
    return round((tokens - 1) * batch / decode_s, 1)


def decode_case(benchmark, generate: Callable[[int], float], tokens: int, batch: int,
                rounds: int, took_path: Callable[[], bool], expected: bool, **info) -> None:
    """One decode benchmark case: under `--benchmark-disable` (CI) one untimed
    `generate(tokens)` that checks the path under test ran exactly when `expected`
    (`took_path()`, read after the run); otherwise a warm-up, the timed rounds of
    `decode_tokens_per_s`, and the rate with `info` in extra_info."""
    if benchmark.disabled:
        benchmark(generate, tokens)
        assert took_path() is expected
        return
    generate(8)  # warm-up
    rate = decode_tokens_per_s(benchmark, generate, tokens, batch, rounds)
    benchmark.extra_info.update(batch=batch, output_len=tokens, threads=2,
                                decode_tokens_per_s=rate, **info)


def shutdown_after_module(llms: dict):
    """A module-scoped autouse fixture that shuts down every LLM left in `llms` (a bench
    module's cache of engines, by key) once the module's cases are done; assign it to a
    module-level name."""
    @pytest.fixture(scope="module", autouse=True)
    def _shutdown():
        yield
        for llm in llms.values():
            llm.shutdown()
        llms.clear()
    return _shutdown
