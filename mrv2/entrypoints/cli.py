"""The `mrv2` command line: `mrv2 generate` (offline generation), `mrv2 serve` (the
OpenAI-compatible server, vLLM's flags) and `mrv2 chat` / `mrv2 complete` (its clients).

Without a model, they use the built-in model, SmolLM2-135M-Instruct as a Q4_1 GGUF installed
from PyPI with the project (mrv2/models/builtin.py), so they work on a fresh machine with no
downloads at run time.
"""

from __future__ import annotations

import argparse
import sys

from mrv2.entrypoints.openai.cli_args import add_serve_args
from mrv2.entrypoints.openai.vllm_serve_options import refuse_unknown_arguments

# Asked through the chat template when no --prompt is given and the model has one (the
# built-in SmolLM2-135M-Instruct does): answers a person can judge.
DEFAULT_QUESTIONS = [
    "What is the capital of France?",
    "Name the three primary colors.",
    "Write a haiku about the sea.",
    "Give me one tip for staying focused while studying.",
]
# Completed as plain text when the model has no chat template.
DEFAULT_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "Once upon a time, in a land far away,",
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model directory, GGUF file, Hub id or org/name/file.gguf "
                             "(default: the built-in SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory or Hub id (default: the model's own)")
    parser.add_argument("--hf-config-path", default=None,
                        help="directory or Hub id whose config.json replaces the model's")
    parser.add_argument("--revision", default=None, help="Hub revision of the model")
    parser.add_argument("--tokenizer-revision", default=None,
                        help="Hub revision of the tokenizer (default: --revision)")
    parser.add_argument("--download-dir", default=None,
                        help="Hub cache directory (default: huggingface_hub's)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", "-q", default=None, choices=["gguf"],
                        help="compute on a quantized GGUF file's blocks (CPU; resident weights "
                             "near the file size). Default: dequantize at load")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV cache size in bytes (vLLM's flag; or --kv-cache-memory-gb)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="what the KV cache stores: auto (the model's dtype), bfloat16 or "
                             "float16 (half the cache's memory and attention's reads)")
    parser.add_argument("--gpu-memory-utilization", "--device-memory-utilization", type=float,
                        default=None,
                        help="share of a GPU's memory the engine may use (default 0.9); "
                             "not used on the CPU")
    parser.add_argument("--num-scheduler-steps", type=int, default=None,
                        help="decode steps one scheduled step may run while every running "
                             "request decodes greedily (vLLM's multi-step decoding; tokens "
                             "then arrive this many at a time; default: 8-32, about 25 ms, "
                             "while no request streams, else 1)")


class CommandParser(argparse.ArgumentParser):
    """argparse's parser, except that the arguments it does not take are refused by
    `refuse_unknown_arguments`: a vLLM option mrv2 lacks is named as such, not as an
    unrecognized argument. No abbreviations (as vLLM's parser): a vLLM option that is a prefix of
    one of mrv2's would otherwise be taken as that option."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(refuse_unknown_arguments(extras))
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="mrv2", description="mrv2 LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation for one or more prompts")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", default=None,
                     help="prompt text; repeat for several (default: a few demo prompts)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    add_serve_args(serve)
    from mrv2.entrypoints.bench import add_bench_parser

    add_bench_parser(sub)  # `mrv2 bench throughput | serve` (mrv2/entrypoints/bench/)
    from mrv2.entrypoints.chat_client import add_client_parsers

    add_client_parsers(sub)  # `mrv2 chat | complete`: clients of a running server
    return parser


def run_generate(args: argparse.Namespace) -> int:
    """Completions of `--prompt`s, or (without any) answers to DEFAULT_QUESTIONS through the
    model's chat template; then the throughput of the whole batch."""
    from mrv2 import LLM, SamplingParams
    from mrv2.entrypoints.openai.cli_args import checkpoint_args
    from mrv2.models.builtin import default_model

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    llm = LLM(default_model(args.model), dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              block_size=args.block_size, seed=args.seed,
              kv_cache_memory_gb=args.kv_cache_memory_gb,
              num_scheduler_steps=args.num_scheduler_steps, **checkpoint_args(args))
    tokenizer = llm.get_tokenizer()
    if args.prompt or getattr(tokenizer, "chat_template", None) is None:
        prompts = args.prompt or DEFAULT_PROMPTS
        outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    else:
        prompts = DEFAULT_QUESTIONS
        outputs = llm.chat([[{"role": "user", "content": q}] for q in prompts], params,
                           use_tqdm=not args.no_progress)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        print(f"Prompt: {prompt!r}\nOutput: {completion.text!r} "
              f"({len(completion.token_ids)} tokens, finish_reason={completion.finish_reason})\n")
    stats = llm.last_stats
    elapsed = stats["elapsed_s"]
    total = stats["num_prompt_tokens"] + stats["num_output_tokens"]
    print(f"Throughput: {stats['num_requests'] / elapsed:.2f} requests/s, "
          f"{total / elapsed:.2f} total tokens/s, "
          f"{stats['num_output_tokens'] / elapsed:.2f} output tokens/s")
    return 0


def main(argv: list[str] | None = None) -> int:
    from mrv2.entrypoints.openai.config_file import expand_config_file

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        argv = expand_config_file(parser, argv)  # `serve --config x.yaml` (vLLM's)
    except ValueError as error:
        print(f"mrv2: error: {error}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "bench":
            from mrv2.entrypoints.bench import run_bench

            return run_bench(args)
        if args.command == "serve":
            from mrv2.entrypoints.openai.api_server import run_server

            return run_server(args)
        if args.command in ("chat", "complete"):
            from mrv2.entrypoints.chat_client import run_client

            return run_client(args)
    except ValueError as error:  # bad input: a clear message, no traceback
        print(f"mrv2: error: {error}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
