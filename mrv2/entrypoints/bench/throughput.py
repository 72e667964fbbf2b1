"""`mrv2 bench throughput`: offline generation of a synthetic workload, vLLM's output line
`Throughput: X requests/s, Y total tokens/s, Z output tokens/s`.

Every request generates exactly `--output-len` tokens (ignore_eos, greedy), so the token
counts are the workload's, not the model's choice.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from mrv2.entrypoints.bench.dataset import random_token_prompts


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    from mrv2.entrypoints.cli import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--dataset", "--dataset-name", dest="dataset", default="random",
                        choices=["random"], help="random token-id prompts (fixed seed)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--output-json", default=None, help="write the results here")


def run_throughput(args: argparse.Namespace) -> int:
    from mrv2 import LLM, SamplingParams

    from mrv2.entrypoints.openai.cli_args import checkpoint_args
    from mrv2.models.builtin import default_model

    model = default_model(args.model)
    if args.output_len < 1:
        raise ValueError(f"--output-len must be >= 1, got {args.output_len}")
    max_model_len = args.max_model_len or args.input_len + args.output_len
    llm = LLM(model, dtype=args.dtype, max_model_len=max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              block_size=args.block_size, seed=args.seed,
              kv_cache_memory_gb=args.kv_cache_memory_gb,
              num_scheduler_steps=args.num_scheduler_steps, **checkpoint_args(args))
    try:
        vocab_size = _vocab_size(llm)
        prompts = random_token_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    num_prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    num_output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = throughput_result(len(outputs), num_prompt_tokens, num_output_tokens, elapsed)
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, "
          f"{result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {num_prompt_tokens}")
    print(f"Total num output tokens:  {num_output_tokens}")
    if args.output_json:
        result.update(model=model, num_prompts=args.num_prompts, input_len=args.input_len,
                      output_len=args.output_len, dataset=args.dataset, seed=args.seed)
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def throughput_result(num_requests: int, num_prompt_tokens: int, num_output_tokens: int,
                      elapsed: float) -> dict[str, Any]:
    """vLLM's JSON keys."""
    total = num_prompt_tokens + num_output_tokens
    return {"elapsed_time": elapsed, "num_requests": num_requests,
            "total_num_tokens": total, "total_output_tokens": num_output_tokens,
            "requests_per_second": num_requests / elapsed,
            "tokens_per_second": total / elapsed,
            "output_tokens_per_second": num_output_tokens / elapsed}


def _vocab_size(llm: Any) -> int:
    """Prompt ids stay inside both the model's and the tokenizer's vocabulary (as vLLM's
    random dataset draws from the tokenizer's)."""
    vocab = llm.llm_engine.config.model_config.vocab_size
    tokenizer = llm.get_tokenizer()
    return vocab if tokenizer is None else min(vocab, len(tokenizer))
