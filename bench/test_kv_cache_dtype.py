"""Decode with a 16-bit KV cache (`kv_cache_dtype`) against the float32 cache, on the built-in
SmolLM2-135M Q4_1 GGUF computed on its blocks (`quantization="gguf"`: the fused decode stack up
to 32 rows).

Long contexts, where the cache's bytes matter: batch 32 of 384 random prompt tokens and batch
1 of 1536, greedy, 64 tokens, EOS ignored, 2 threads. Prefix caching is on so that the rounds, which
repeat the prompts, skip their prefill (12,288 prompt tokens at batch 32): the decode steps,
what is compared here, read the same cached K/V either way. At batch 32 and ~420 tokens of
context a step reads ~590 MB of float32 K/V (30 layers x 3 kv heads x 64 x 2 x 4 bytes a token)
against ~66 MB of Q4_1 blocks; at batch 1 and ~1570 tokens, ~72 MB. A 16-bit cache halves
those reads; whether that is faster depends on whether attention waits on memory or on its
arithmetic (bench/README.md). Each
timed round generates 64 tokens and then 1: extra_info `decode_tokens_per_s` = 63 * batch /
(median 64-token seconds - median 1-token seconds). One LLM per cache dtype serves the module;
compare dtypes from one run (bench/README.md has the figures).

Under `--benchmark-disable` (CI) the cases skip: what they run is tested in
tests/entrypoints/test_llm_kv_cache_dtype.py and tests/models/cpu/test_decode.py, and one
untimed pass would cost CI ~20 s (the built-in model's load and a 1536-token prefill).
"""

from __future__ import annotations

import pytest

from gguf_workload import (decode_tokens_per_s, gguf_path, greedy_timer,
                           shutdown_after_module, token_id_prompts)

ROUNDS = 5
OUTPUT_LEN = 64
# Batch -> prompt tokens.
PROMPT_LENS = {1: 1536, 32: 384}
_LLMS: dict[str, object] = {}

pytestmark = pytest.mark.usefixtures("two_threads")  # bench/conftest.py


def _llm(kv_cache_dtype: str):
    from mrv2 import LLM

    if kv_cache_dtype not in _LLMS:
        _LLMS[kv_cache_dtype] = LLM(str(gguf_path()), max_model_len=1664, max_num_seqs=32,
                                    kv_cache_memory_gb=1.0, enable_prefix_caching=True,
                                    quantization="gguf", kv_cache_dtype=kv_cache_dtype)
    return _LLMS[kv_cache_dtype]


_shutdown = shutdown_after_module(_LLMS)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "float16"])
@pytest.mark.parametrize("batch", [1, 32])
def test_kv_cache_dtype_decode(benchmark, batch, kv_cache_dtype):
    if benchmark.disabled:
        pytest.skip("timed runs only (see the module docstring)")
    llm = _llm(kv_cache_dtype)
    prompts = token_id_prompts(batch, PROMPT_LENS[batch])
    tokens = OUTPUT_LEN

    generate = greedy_timer(llm, prompts)

    benchmark.group = f"kv-cache-dtype-b{batch}"
    generate(4)  # warm-up
    rate = decode_tokens_per_s(benchmark, generate, tokens, batch, ROUNDS)
    benchmark.extra_info.update(
        kv_cache_dtype=kv_cache_dtype, batch=batch, prompt_len=PROMPT_LENS[batch],
        output_len=tokens, threads=2, decode_tokens_per_s=rate)
