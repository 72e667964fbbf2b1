"""The logprob error bound of mrv2/testing/logprob_bound.py on the built-in SmolLM2 Q4_1 file, by
hand:

    python bench/logprob_bound.py [num_prompts] [new_tokens]

For each path (blocks with float32 or int8 x, 16-bit weights, a bfloat16 KV cache, float32
weights) and each of the first chat prompts of tests/entrypoints/test_llm_gguf.py: mrv2's greedy
completion with each token's logprob (the first from the prefill, the others from decode steps),
against the float64 model of the file's dequantized weights on the same tokens. Prints per path
the largest and median |error| (nats), the median first-order bound and RMS estimate, the worst
error / bound (<= 1 is the claim), and how many completions equal the float32 path's.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from mrv2 import LLM, SamplingParams
from mrv2.models.builtin import builtin_model_path
from mrv2.models.layers import linear_plan, quantized_numba
from mrv2.models.layers.quantized_int8_numba import X86_INT8_DOTS
from mrv2.testing.logprob_bound import (BFLOAT16_UNIT_ROUNDOFF, FLOAT16_UNIT_ROUNDOFF, Rounding,
                                        logprob_bounds)

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "entrypoints"))
from test_llm_gguf import QUESTIONS  # noqa: E402

BLOCKS = Rounding(weights_in_blocks=True)
F32, I16, I8 = quantized_numba.X_FLOAT32, quantized_numba.X_INT16, quantized_numba.X_INT8
# name: (LLM kwargs, the GEMV's x format, rounding)
PATHS = {
    "float32 weights": (dict(dtype="float32"), F32, BLOCKS),
    "blocks, float32 x": (dict(quantization="gguf"), F32, BLOCKS),
    "blocks, int16 x (default)": (dict(quantization="gguf"), I16,
                                  Rounding(activation_levels=32767, weights_in_blocks=True)),
    "blocks, int8 x": (dict(quantization="gguf"), I8,
                       Rounding(activation_levels=127, weights_in_blocks=True)),
    "bf16 weights": (dict(dtype="bfloat16"), F32,
                     Rounding(weight_unit_roundoff=BFLOAT16_UNIT_ROUNDOFF, weights_in_blocks=True)),
    "f16 weights": (dict(dtype="float16"), F32,
                    Rounding(weight_unit_roundoff=FLOAT16_UNIT_ROUNDOFF, weights_in_blocks=True)),
    "blocks, bf16 KV cache": (dict(quantization="gguf", kv_cache_dtype="bfloat16"), F32,
                              Rounding(kv_unit_roundoff=BFLOAT16_UNIT_ROUNDOFF,
                                       weights_in_blocks=True)),
}


def greedy_with_logprobs(prompts: list[list[int]], new_tokens: int, kwargs: dict
                         ) -> tuple[list[list[int]], list[list[float]], bool]:
    llm = LLM(str(builtin_model_path()), max_model_len=512, kv_cache_memory_gb=0.1, **kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                          ignore_eos=True, logprobs=0), use_tqdm=False)
    config = llm.llm_engine.engine_core.config.model_config
    native = config.dtype != torch.float32 and config.cpu_weight_dtype is None
    llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, ids)]
                for o, ids in zip(outputs, tokens)]
    return tokens, logprobs, native


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mrv2.testing.gguf_twin import safetensors_twin

    num_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    new_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    twin = safetensors_twin(builtin_model_path())
    hf = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32)
    config, state = hf.config, hf.state_dict()
    tok = AutoTokenizer.from_pretrained(twin)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}],
                                       add_generation_prompt=True, return_dict=False)
               for q in QUESTIONS[:num_prompts]]
    runs = {}
    for name, (kwargs, x_format, rounding) in PATHS.items():
        if x_format != F32 and not X86_INT8_DOTS:
            print(f"{name}: skipped (integer x needs x86 AVX2)")
            continue
        linear_plan.GEMV_X_FORMAT = x_format
        tokens, logprobs, native = greedy_with_logprobs(prompts, new_tokens, kwargs)
        if native:
            print(f"{name}: skipped (this CPU computes in 16 bits; the bound covers 16-bit "
                  "weights with float32 compute)")
            continue
        runs[name] = (tokens, logprobs, rounding)
    linear_plan.GEMV_X_FORMAT = linear_plan._gemv_x_format()
    reference_tokens = runs["float32 weights"][0]
    print(f"{num_prompts} prompts x {new_tokens} greedy tokens, SmolLM2-135M-Instruct Q4_1, "
          f"logprobs in nats")
    print("| path | max |error| | median |error| | median bound | median RMS estimate | "
          "max error / bound | median error / RMS | completions = float32's |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (tokens, logprobs, rounding) in runs.items():
        started = time.perf_counter()
        errors, bounds, rms = [], [], []
        for prompt, completion, got in zip(prompts, tokens, logprobs):
            sequence = prompt + completion
            targets = [(len(prompt) - 1 + i, t) for i, t in enumerate(completion)]
            exact, (b,) = logprob_bounds(config, state, sequence[:-1], targets, (rounding,))
            errors += (torch.tensor(got, dtype=torch.float64) - exact).abs().tolist()
            bounds += b.bound.tolist()
            rms += b.rms.tolist()
        same = sum(a == b for a, b in zip(tokens, reference_tokens))
        worst = max(e / b for e, b in zip(errors, bounds))
        typical = statistics.median(e / r for e, r in zip(errors, rms))
        print(f"| {name} | {max(errors):.2e} | {statistics.median(errors):.2e} | "
              f"{statistics.median(bounds):.2e} | {statistics.median(rms):.2e} | {worst:.3f} | "
              f"{typical:.2f} | {same}/{len(tokens)} |", flush=True)
        print(f"  ({time.perf_counter() - started:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
