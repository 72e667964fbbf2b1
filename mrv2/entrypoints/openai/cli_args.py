"""`mrv2 serve` flags, with vLLM's names, and what they become: EngineArgs + ServerConfig.

A flag whose dest is an EngineArgs field is an engine setting: its value goes to EngineArgs
whole, and EngineArgs checks it (so `LLM(name=value)` and `--name value` mean the same). The
server's own settings (HTTP, chat template, tool parser, logging) are ServerConfig's; the few
the server reads from the engine's (generation config, stats log) are copied from EngineArgs.

This module stays light (no torch, FastAPI or engine import at module level): `mrv2 --help`
builds every sub-parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mrv2.entrypoints.openai.engine_flags import add_engine_flags, engine_flag_values

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
    # vLLM's HTTP flags: CORS (vLLM's defaults: everything allowed, no credentials), TLS, the
    # ASGI root path, request logging, the periodic stats log, /load's request count, the docs.
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    root_path: str | None = None
    enable_log_requests: bool = False
    max_log_len: int | None = None
    disable_log_stats: bool = False
    enable_server_load_tracking: bool = True
    disable_uvicorn_access_log: bool = False
    disable_fastapi_docs: bool = False
    # Checked per request by the server (the engine's EngineArgs.max_logprobs is the same).
    max_logprobs: int | None = None
    # Generation-config fields (vLLM's --override-generation-config) over --generation-config's.
    override_generation_config: dict[str, Any] = field(default_factory=dict)

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
    parser.add_argument("--enable-expert-parallel", "-ep", action=argparse.BooleanOptionalAction,
                        default=False, help="MoE models: each tensor-parallel rank holds 1/tp of "
                        "the experts, whole, instead of 1/tp of every expert")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=None, help="default on (off with --pooler-config MEAN pooling)")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction,
                        default=False)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None, help="default on (off with --speculative-config)")
    parser.add_argument("--chat-template", default=None,
                        help="a chat template file, or the template itself")
    parser.add_argument("--generation-config", default="auto",
                        help="auto: the model's generation_config.json gives default sampling "
                             "parameters; vllm: OpenAI's defaults; a folder path: the "
                             "generation_config.json in that folder")
    parser.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction,
                        default=False,
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
    add_engine_flags(parser)
    add_http_flags(parser)


def add_http_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's frontend flags: config file, CORS, TLS, root path, logging, docs."""
    parser.add_argument("--config", default=None,
                        help="a YAML file of flag values (long names); the command line wins")
    for name in ("origins", "methods", "headers"):
        parser.add_argument(f"--allowed-{name}", type=json.loads, default=["*"],
                            help=f'CORS: a JSON list of allowed {name} (default ["*"])')
    parser.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction,
                        default=False, help="CORS: credentials")
    parser.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key file")
    parser.add_argument("--ssl-certfile", default=None, help="... and this certificate file")
    parser.add_argument("--ssl-ca-certs", default=None, help="CA certificates file (uvicorn)")
    parser.add_argument("--ssl-cert-reqs", type=int, default=0,
                        help="whether a client certificate is required (Python's ssl module)")
    parser.add_argument("--root-path", default=None,
                        help="FastAPI root_path when behind a path-based proxy")
    parser.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction,
                        default=False, help="log each request (mrv2's logger, INFO)")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="vLLM's older flag: requests are not logged (the default)")
    parser.add_argument("--max-log-len", type=int, default=None,
                        help="characters of a logged request kept (default: all)")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic engine stats in the log")
    parser.add_argument("--enable-server-load-tracking", action=argparse.BooleanOptionalAction,
                        default=True, help="count in-flight requests for /load (default on)")
    parser.add_argument("--disable-uvicorn-access-log", action=argparse.BooleanOptionalAction,
                        default=False)
    parser.add_argument("--disable-fastapi-docs", action=argparse.BooleanOptionalAction,
                        default=False,
                        help="no /docs, /redoc or /openapi.json")
    parser.add_argument("--override-generation-config", type=json.loads, default=None,
                        help='JSON generation-config fields over --generation-config\'s, e.g. '
                             '\'{"temperature": 0.5}\' (with "vllm": only these)')


def resolve_model(args: argparse.Namespace) -> str:
    from mrv2.models.builtin import default_model

    return default_model(args.model_tag or args.model)


def engine_args_from(args: argparse.Namespace, model: str) -> "EngineArgs":
    """The EngineArgs of every flag whose dest is one of its fields (ConfigError naming a value
    it refuses)."""
    from mrv2.engine.arg_utils import EngineArgs

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)
              if hasattr(args, f.name)}
    return EngineArgs(**{**values, **engine_flag_values(args), "model": model})


def checkpoint_args(args: argparse.Namespace) -> dict[str, str | None]:
    """EngineArgs fields of the checkpoint flags that `generate`, `serve` and `bench` share
    (mrv2.entrypoints.cli.add_engine_args)."""
    return {name: getattr(args, name) for name in
            ("tokenizer", "hf_config_path", "revision", "tokenizer_revision", "download_dir",
             "quantization", "kv_cache_memory_bytes", "gpu_memory_utilization",
             "kv_cache_dtype")}


def server_config_from(args: argparse.Namespace, model: str) -> ServerConfig:
    from mrv2.engine.engine_args_checks import check_generation_overrides
    from mrv2.entrypoints.chat_utils import load_chat_template

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not a TCP port")
    engine = engine_args_from(args, model)  # a refused engine flag fails before anything else
    check_http_flags(args)
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
                        generation_config=engine.generation_config,
                        uvicorn_log_level=args.uvicorn_log_level,
                        tool_call_parser=args.tool_call_parser,
                        reasoning_parser=engine.reasoning_parser,
                        allowed_origins=args.allowed_origins,
                        allowed_methods=args.allowed_methods,
                        allowed_headers=args.allowed_headers,
                        allow_credentials=args.allow_credentials, ssl_keyfile=args.ssl_keyfile,
                        ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                        ssl_cert_reqs=args.ssl_cert_reqs, root_path=args.root_path,
                        enable_log_requests=args.enable_log_requests,
                        max_log_len=args.max_log_len,
                        disable_log_stats=engine.disable_log_stats,
                        enable_server_load_tracking=args.enable_server_load_tracking,
                        disable_uvicorn_access_log=args.disable_uvicorn_access_log,
                        disable_fastapi_docs=args.disable_fastapi_docs,
                        max_logprobs=args.max_logprobs,
                        override_generation_config=check_generation_overrides(
                            engine.override_generation_config))


def check_http_flags(args: argparse.Namespace) -> None:
    """TLS files exist, CORS lists are lists, and no contradictory flags: before the model
    loads."""
    if args.enable_log_requests and args.disable_log_requests:
        raise ValueError("--enable-log-requests and --disable-log-requests contradict")
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        value = getattr(args, name)
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ValueError(f"--{name.replace('_', '-')} must be a JSON list of strings, "
                             f"got {value!r}")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, name)
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--{name.replace('_', '-')} {path!r}: no such file")
