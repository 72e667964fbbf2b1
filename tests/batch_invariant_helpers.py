"""A child program for tests/test_batch_invariant.py (the mode is process-wide, so each engine
under test runs alone in a process): one target request's greedy token ids and logprobs
alone, among other requests drawn by hypothesis-style random compositions (counts, lengths,
its place in the batch), after a prefix-cache hit, with a small chunked-prefill budget, and
at 1 numba thread; written as JSON, one entry per case.

    python batch_invariant_helpers.py OUT.json MODEL DTYPE QUANTIZATION|none MODE(0|1)
    python batch_invariant_helpers.py OUT.json demo DTYPE none 1   (the demo's chats)
"""

from __future__ import annotations

import json
import random
import sys


def _signature(output) -> dict:
    completion = output.outputs[0]
    return {"token_ids": list(completion.token_ids),
            "logprobs": [sorted((t, lp.logprob) for t, lp in step.items())
                         for step in completion.logprobs]}


def cases(model: str, dtype: str, quantization: str | None, invariant: bool) -> dict:
    import numba

    from mrv2 import LLM, SamplingParams

    rng = random.Random(1234)

    def prompt(length: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(3, 250) for _ in range(length)]}

    target = prompt(29)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    common = dict(dtype=dtype, quantization=quantization, batch_invariant=invariant,
                  max_model_len=128, kv_cache_memory_gb=0.05)
    out: dict[str, dict] = {}
    llm = LLM(model, enable_prefix_caching=True, max_num_seqs=32, **common)
    try:
        out["alone"] = _signature(llm.generate([target], params, use_tqdm=False)[0])
        out["prefix cache hit"] = _signature(llm.generate([target], params, use_tqdm=False)[0])
        for n in (1, 3, 7, 31):
            others = [prompt(rng.randrange(2, 60)) for _ in range(n)]
            place = rng.randrange(n + 1)
            batch = others[:place] + [target] + others[place:]
            outputs = llm.generate(batch, params, use_tqdm=False)
            out[f"among {n}, at {place}"] = _signature(outputs[place])
            out[f"among {n}, last"] = _signature(
                llm.generate(others + [target], params, use_tqdm=False)[-1])
        numba.set_num_threads(1)
        out["1 thread, among 7"] = _signature(
            llm.generate([target] + [prompt(rng.randrange(2, 60)) for _ in range(7)], params,
                         use_tqdm=False)[0])
    finally:
        llm.shutdown()
    llm = LLM(model, enable_prefix_caching=False, max_num_batched_tokens=8, **common)
    try:
        others = [prompt(rng.randrange(2, 40)) for _ in range(3)]
        out["chunks of 8 tokens"] = _signature(
            llm.generate(others + [target], params, use_tqdm=False)[-1])
    finally:
        llm.shutdown()
    return out


def demo_chats(dtype: str) -> dict:
    """The built-in SmolLM2's answers to the demo's chats in batch-invariant mode, all four in
    one batch and each alone (a real vocabulary: torch's logsumexp split a lone row over the
    threads, and moved its logprobs in the last bit)."""
    from mrv2 import LLM, SamplingParams
    from mrv2.entrypoints.cli import DEFAULT_QUESTIONS
    from mrv2.models.builtin import builtin_model_path

    llm = LLM(str(builtin_model_path()), dtype=dtype, batch_invariant=True,
              max_model_len=256, kv_cache_memory_gb=0.05)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2)
        # Seeded sampling through every filter (min-p, top-k, top-p on the full sort of a
        # 49152-token row): the filters' sums must not follow the batch either.
        sampled = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, seed=11,
                                 max_tokens=10, logprobs=2)
        chats = [[{"role": "user", "content": q}] for q in DEFAULT_QUESTIONS]
        out = {}
        for name, params in (("greedy", greedy), ("sampled", sampled)):
            together = llm.chat(chats, params, use_tqdm=False)
            alone = [llm.chat([chat], params, use_tqdm=False)[0] for chat in chats]
            out[name] = {"together": [_signature(o) for o in together],
                         "alone": [_signature(o) for o in alone]}
    finally:
        llm.shutdown()
    return out


if __name__ == "__main__":
    out_path, model, dtype, quantization, mode = sys.argv[1:6]
    if model == "demo":
        result = demo_chats(dtype)
    else:
        result = cases(model, dtype, None if quantization == "none" else quantization,
                       mode == "1")
    with open(out_path, "w") as f:
        json.dump(result, f)
