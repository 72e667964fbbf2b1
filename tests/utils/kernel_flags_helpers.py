"""A child program for tests/utils/test_kernel_flags.py: the built-in SmolLM2's greedy answers
to the demo's chat prompts, token ids and logprobs, written as JSON. Run it with
NUMBA_CACHE_DIR set to compare kernels compiled in the process with kernels loaded from disk.

    python kernel_flags_helpers.py OUT.json DTYPE QUANTIZATION|none [MAX_TOKENS]
"""

from __future__ import annotations

import json
import sys


def answers(dtype: str, quantization: str | None, max_tokens: int) -> list[dict]:
    from mrv2 import LLM, SamplingParams
    from mrv2.entrypoints.cli import DEFAULT_QUESTIONS
    from mrv2.models.builtin import builtin_model_path

    llm = LLM(str(builtin_model_path()), dtype=dtype, quantization=quantization,
              max_model_len=256, kv_cache_memory_gb=0.05)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2)
        outputs = llm.chat([[{"role": "user", "content": q}] for q in DEFAULT_QUESTIONS],
                           params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [{"token_ids": list(o.outputs[0].token_ids),
             "logprobs": [{str(t): lp.logprob for t, lp in step.items()}
                          for step in o.outputs[0].logprobs]} for o in outputs]


if __name__ == "__main__":
    out_path, dtype, quantization = sys.argv[1:4]
    max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 24
    result = answers(dtype, None if quantization == "none" else quantization, max_tokens)
    with open(out_path, "w") as f:
        json.dump(result, f)
