"""Greedy fidelity of the built-in Q4_1 file's quantized paths against mrv2 float32, by hand:

    python bench/gguf_agreement.py

The 8 chat prompts of tests/entrypoints/test_llm_gguf.py, greedy, up to 64 tokens (EOS ends).
Prints, per path, how many completions equal float32's, where the others first differ and,
per position, how many equal float32's through it: `quantization="gguf"` on float32, int16
(the default) and int8 x (MRV2_GGUF_ACTIVATIONS), dtype="bfloat16" (bf16 weights, KV cache and,
where the CPU has bf16 matrix units, linears of several rows) and the defaults (dtype "auto")
with the 8 prompts in one batch and each alone, the defaults' int8 prefill (where it runs:
the prompts put after a system text long enough to reach it) against the bfloat16 copies
alone (MRV2_GGUF_PREFILL=bf16), and llama.cpp on the same file when llama-cpp-python is
installed (the `peers` extra).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from mrv2 import LLM, SamplingParams, cpu_caps
from mrv2.models.builtin import builtin_model_path
from mrv2.models.layers import int8_linear, linear_plan, quantized, quantized_numba
from mrv2.models.layers.quantized_int8_numba import X86_INT8_DOTS

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "entrypoints"))
from test_llm_gguf import QUESTIONS  # noqa: E402

MAX_TOKENS = 64


# A system turn put before each chat prompt so that its prefill passes MIN_INT8_ROWS tokens.
SYSTEM = ("You are a helpful assistant. Answer the user's question directly, in plain words, "
          "with one or two short sentences. Do not add a greeting, a summary or a list. If a "
          "question has a number for an answer, give the number first and then its unit. Keep "
          "every answer factual and brief; say so when you do not know.")


def _prompts_eos_and_system() -> tuple[list[list[int]], set[int], list[int]]:
    llm = LLM(str(builtin_model_path()), max_model_len=512, kv_cache_memory_gb=0.1)
    tokenizer = llm.get_tokenizer()
    eos = llm.llm_engine.engine_core.config.model_config.hf_config.eos_token_id
    llm.shutdown()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True, return_dict=False)
               for q in QUESTIONS]
    system = tokenizer.encode(SYSTEM, add_special_tokens=False)
    if len(system) < linear_plan.MIN_INT8_ROWS:
        raise RuntimeError(f"the system turn is {len(system)} tokens: fewer than MIN_INT8_ROWS")
    return prompts, set(eos if isinstance(eos, list) else [eos]), system


def mrv2_greedy(prompts: list[list[int]], **kwargs) -> list[list[int]]:
    llm = LLM(str(builtin_model_path()), max_model_len=512, kv_cache_memory_gb=0.1, **kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                           use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs]


def llama_cpp_greedy(prompts: list[list[int]], eos: set[int]) -> list[list[int]] | None:
    """llama.cpp through the sweep's engine (which keeps ggml's AMX matmul, crashing in
    llama-cpp-python 0.3.36, off where the CPU has AMX), each completion cut at its EOS."""
    from mrv2.entrypoints.bench import sweep_engines

    if sweep_engines._import_peer("llama.cpp")[1] is not None:
        return None
    model = sweep_engines.read_sweep_model(str(builtin_model_path()))
    setup = sweep_engines.SweepSetup(max_batch=1, input_len=max(map(len, prompts)),
                                     output_len=MAX_TOKENS, seed=0, threads=2)
    spec = sweep_engines.EngineSpec("llama.cpp", "llama.cpp", "gguf")
    engine = sweep_engines.load_engine(spec, model, setup)
    out = []
    for prompt in prompts:
        tokens = engine.generate([prompt], MAX_TOKENS)[0]
        stop = next((i + 1 for i, token in enumerate(tokens) if token in eos), len(tokens))
        out.append(tokens[:stop])
    engine.shutdown()
    return out


def report(name: str, got: list[list[int]], want: list[list[int]]) -> None:
    """Completions equal to float32's, where the others first differ, and per position p (1,
    2, 4, ..., MAX_TOKENS) how many completions still equal float32's through token p."""
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
             for a, b in zip(got, want) if a != b]
    same = sum(a == b for a, b in zip(got, want))
    print(f"{name}: {same}/{len(want)} completions equal float32's; the others first differ "
          f"at token {first}")
    agree_through = [MAX_TOKENS if a == b else next(
        i for i, (x, y) in enumerate(zip(a + [-1], b + [-2])) if x != y)
        for a, b in zip(got, want)]
    positions = [1 << i for i in range(MAX_TOKENS.bit_length()) if 1 << i <= MAX_TOKENS]
    print("  equal through token " + ", ".join(
        f"{p}: {sum(t >= p for t in agree_through)}/{len(want)}" for p in positions))


def main() -> None:
    prompts, eos, pad = _prompts_eos_and_system()
    reference = mrv2_greedy(prompts, dtype="float32")
    formats = {"float32": quantized_numba.X_FLOAT32, "int16 (default)": quantized_numba.X_INT16,
               "int8": quantized_numba.X_INT8}
    for name, x_format in formats.items():
        if x_format != quantized_numba.X_FLOAT32 and not X86_INT8_DOTS:
            continue  # integer x needs AVX2 code generation
        linear_plan.GEMV_X_FORMAT = x_format
        report(f"gguf blocks, {name} x", mrv2_greedy(prompts, quantization="gguf"), reference)
    linear_plan.GEMV_X_FORMAT = linear_plan._gemv_x_format()
    natively = quantized.computes_natively(torch.bfloat16)
    report("bfloat16 weights, the 8 prompts in one batch (on the CPU's bf16 matrix units from "
           f"{linear_plan.MIN_NATIVE_HALF_ROWS} rows: {natively})",
           mrv2_greedy(prompts, dtype="bfloat16"), reference)
    report("bfloat16 weights, each prompt alone",
           [mrv2_greedy([p], dtype="bfloat16")[0] for p in prompts], reference)
    # dtype "auto" (loader.cpu_auto_gguf): the blocks alone where the CPU runs float32; where
    # it runs bfloat16, the blocks up to MAX_BLOCK_ROWS_BESIDE_COPY rows, bfloat16 copies beyond
    # and where oneDNN multiplies int8 on VNNI, a prompt's rows (from MIN_INT8_ROWS) on int8
    # products (the chat prompts here are shorter: their prefill stays on the copies)
    report("the defaults, the 8 prompts in one batch", mrv2_greedy(prompts), reference)
    report("the defaults, each prompt alone", [mrv2_greedy([p])[0] for p in prompts], reference)
    if int8_linear.int8_products_run():
        padded = [pad + p for p in prompts]  # every prompt past MIN_INT8_ROWS tokens
        padded_reference = mrv2_greedy(padded, dtype="float32")
        report("the defaults (int8 prefill), prompts past MIN_INT8_ROWS tokens",
               mrv2_greedy(padded), padded_reference)
        os.environ[cpu_caps.GGUF_PREFILL_ENV] = "bf16"
        cpu_caps.caps.cache_clear()
        report("MRV2_GGUF_PREFILL=bf16 (the bfloat16 copies), the same prompts",
               mrv2_greedy(padded), padded_reference)
        del os.environ[cpu_caps.GGUF_PREFILL_ENV]
        cpu_caps.caps.cache_clear()
    peer = llama_cpp_greedy(prompts, eos)
    if peer is not None:
        report("llama.cpp", peer, reference)


if __name__ == "__main__":
    main()
