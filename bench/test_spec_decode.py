"""Speculative decoding (issue 52) on the built-in SmolLM2 GGUF: copy-heavy chat prompts at
batch 1, ngram and suffix drafts against no drafts, in the same run, alternating
(spec_decode_workload.py has the whole table, llama.cpp's prompt lookup included).

Each round runs mrv2 without drafts in the untimed setup (timed by hand), then with drafts
(timed by pytest-benchmark); `extra_info["speedup"]` is median(no drafts) / median(drafts),
higher is better (target 1.8). Greedy outputs must be identical. Under --benchmark-disable
(CI) a few tokens, one round: the case still runs both engines end to end.
"""

from __future__ import annotations

import statistics

import pytest

from spec_decode_workload import METHODS, chat_prompts, run_mrv2

ROUNDS = 3


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_copy_heavy_batch_1(benchmark, method):
    from mrv2 import LLM
    from mrv2.models.builtin import builtin_model_path

    if benchmark.disabled and method != "ngram":  # CI's smoke run: one method does
        pytest.skip("tests/spec_decode/ checks every method; the smoke run times one")
    max_tokens = 8 if benchmark.disabled else 128
    model = str(builtin_model_path())
    engine = {"max_model_len": 1024, "kv_cache_memory_gb": 0.25}
    plain = LLM(model, **engine)
    spec = LLM(model, speculative_config=METHODS[method], **engine)
    prompts = chat_prompts("copy", 1)
    want = run_mrv2(plain, prompts, max_tokens)[1]
    assert run_mrv2(spec, prompts, max_tokens)[1] == want  # lossless, and warm
    plain_seconds: list[float] = []

    def setup():
        plain_seconds.append(run_mrv2(plain, prompts, max_tokens)[0])
        return (), {}

    benchmark.group = "spec-decode-copy-b1"
    benchmark.pedantic(lambda: run_mrv2(spec, prompts, max_tokens), setup=setup,
                       rounds=1 if benchmark.disabled else ROUNDS, warmup_rounds=0)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:
        benchmark.extra_info.update(
            speedup=statistics.median(plain_seconds) / stats.stats.median,
            plain_median_s=statistics.median(plain_seconds), rounds=ROUNDS)
