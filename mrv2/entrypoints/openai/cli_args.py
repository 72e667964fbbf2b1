"""`mrv2 serve` flags, with vLLM's names, and what they become: EngineArgs + ServerConfig.

This module stays light (no torch, FastAPI or engine import at module level): `mrv2 --help`
builds every sub-parser.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mrv2.engine.arg_utils import EngineArgs

API_KEY_ENV = "VLLM_API_KEY"


@dataclass
class ServerConfig:
    model: str
    served_model_names: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    chat_template: str | None = None  # the template text (a --chat-template file is read)
    generation_config: str = "auto"
    uvicorn_log_level: str = "info"
    # Tool calling with tool_choice "auto" (vLLM's --enable-auto-tool-choice and
    # --tool-call-parser: the parser is set only when both are given).
    tool_call_parser: str | None = None
    # Splits <think>...</think> off chat messages (the engine's structured outputs follow the
    # same setting: EngineArgs.reasoning_parser).
    reasoning_parser: str | None = None

    @property
    def model_name(self) -> str:
        """The name responses carry."""
        return self.served_model_names[0]


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The `serve` sub-command's flags (the engine ones shared with `generate` come from
    mrv2.entrypoints.cli.add_engine_args)."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="model directory, GGUF file or Hub id (default: the built-in "
                             "SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1 (or ${API_KEY_ENV})")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use; the first is the one responses carry")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=True)
    parser.add_argument("--chat-template", default=None,
                        help="a chat template file, or the template itself")
    parser.add_argument("--generation-config", default="auto",
                        help="auto: the model's generation_config.json gives default sampling "
                             "parameters; vllm: OpenAI's defaults; a folder path: the "
                             "generation_config.json in that folder")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='tool_choice "auto": parse tool calls from the output with '
                             "--tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None,
                        help="hermes (Qwen2.5, Qwen3, Hermes, SmolLM2) or llama3_json")
    parser.add_argument("--reasoning-parser", default=None,
                        help="qwen3 or deepseek_r1: <think>...</think> goes to the message's "
                             "reasoning field, and structured outputs apply after it")
    parser.add_argument("--structured-outputs-config", default=None, type=json.loads,
                        help='JSON, e.g. \'{"disable_any_whitespace": true}\' (vLLM\'s fields: '
                             "backend, disable_any_whitespace, disable_additional_properties, "
                             "reasoning_parser, enable_in_reasoning)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug", "trace"))


def resolve_model(args: argparse.Namespace) -> str:
    from mrv2.models.builtin import default_model

    return default_model(args.model_tag or args.model)


def engine_args_from(args: argparse.Namespace, model: str) -> "EngineArgs":
    from mrv2.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, dtype=args.dtype, max_model_len=args.max_model_len,
                      max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      block_size=args.block_size, seed=args.seed,
                      kv_cache_memory_gb=args.kv_cache_memory_gb,
                      tensor_parallel_size=args.tensor_parallel_size,
                      enable_prefix_caching=args.enable_prefix_caching,
                      enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
                      structured_outputs_config=args.structured_outputs_config,
                      reasoning_parser=args.reasoning_parser, **checkpoint_args(args))


def checkpoint_args(args: argparse.Namespace) -> dict[str, str | None]:
    """EngineArgs fields of the checkpoint flags that `generate`, `serve` and `bench` share
    (mrv2.entrypoints.cli.add_engine_args)."""
    return {name: getattr(args, name) for name in
            ("tokenizer", "hf_config_path", "revision", "tokenizer_revision", "download_dir",
             "quantization", "kv_cache_memory_bytes", "gpu_memory_utilization")}


def server_config_from(args: argparse.Namespace, model: str) -> ServerConfig:
    from mrv2.entrypoints.chat_utils import load_chat_template
    from mrv2.entrypoints.openai.generation_config import check_mode

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not a TCP port")
    check_mode(args.generation_config)
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together")
    if args.tool_call_parser is not None:
        from mrv2.entrypoints.openai.tool_parsers import get_tool_parser

        get_tool_parser(args.tool_call_parser)  # ValueError naming the valid ones
    names = args.served_model_name or [model]
    if not (args.served_model_name or args.model_tag or args.model):
        from mrv2.models.builtin import BUILTIN_SERVED_NAME

        names = [BUILTIN_SERVED_NAME, model]  # the built-in model: a short name, and its path
    return ServerConfig(model=model, served_model_names=names,
                        host=args.host, port=args.port,
                        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                        chat_template=load_chat_template(args.chat_template),
                        generation_config=args.generation_config,
                        uvicorn_log_level=args.uvicorn_log_level,
                        tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser)
