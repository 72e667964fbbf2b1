"""Speculative decoding (issue 52) on the built-in SmolLM2 GGUF: copy-heavy chat prompts at
batch 1, ngram and suffix drafts against no drafts, in the same run, alternating
(spec_decode_workload.py has the whole table, llama.cpp's prompt lookup included).

Each round runs mrv2 without drafts in the untimed setup (timed by hand), then with drafts
(timed by pytest-benchmark); `extra_info["speedup"]` is median(no drafts) / median(drafts),
higher is better (target 1.8). Greedy outputs must be identical. Skipped under
--benchmark-disable (CI): tests/spec_decode/ runs the methods end to end.
"""

from __future__ import annotations

import statistics

import pytest

from spec_decode_workload import METHODS, chat_prompts, run_mrv2

ROUNDS = 3


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_copy_heavy_batch_1(benchmark, method):
    """draft_model: the file dequantized to float32, its own Q4_1 blocks as the draft
    (draft_model_workload.py has the table)."""
    from mrv2 import LLM
    from mrv2.models.builtin import builtin_model_path

    if benchmark.disabled:  # two SmolLM2 engines cost CI ~15 s for no figure
        pytest.skip("timing only: tests/spec_decode/ runs every method end to end")
    max_tokens = 128
    model = str(builtin_model_path())
    engine = {"max_model_len": 1024, "kv_cache_memory_gb": 0.25}
    config = METHODS.get(method)
    if method == "draft_model":
        engine["dtype"] = "float32"
        config = {"model": model, "quantization": "gguf", "num_speculative_tokens": 4}
    plain = LLM(model, **engine)
    spec = LLM(model, speculative_config=config, **engine)
    prompts = chat_prompts("copy", 1)
    want = run_mrv2(plain, prompts, max_tokens)[1]
    assert run_mrv2(spec, prompts, max_tokens)[1] == want  # lossless, and warm
    plain_seconds: list[float] = []

    def setup():
        plain_seconds.append(run_mrv2(plain, prompts, max_tokens)[0])
        return (), {}

    benchmark.group = "spec-decode-copy-b1"
    benchmark.pedantic(lambda: run_mrv2(spec, prompts, max_tokens), setup=setup,
                       rounds=ROUNDS, warmup_rounds=0)
    benchmark.extra_info.update(
        speedup=statistics.median(plain_seconds) / benchmark.stats.stats.median,
        plain_median_s=statistics.median(plain_seconds), rounds=ROUNDS)
