"""vLLM's engine-side `serve` flags beyond mrv2's own: each is honoured (its value reaches
EngineArgs or ServerConfig) or refused with a ValueError naming it; none is accepted and
ignored.

- `-O` / `--optimization-level` N, `--compilation-config` / `-cc` JSON (or a level): mrv2 has no
  torch.compile, only CUDA graphs (mrv2.config.CompilationConfig). -O0 turns them off (vLLM's
  O0: no cudagraphs); -O1..3 keep mrv2's default mode. Explicit `--compilation-config` fields win
  over the level, as in vLLM. A field mrv2 lacks is refused by EngineArgs, naming it.
- `--max-logprobs`: EngineArgs.max_logprobs (the server checks requests against it too).
- `--trust-remote-code`: a permission. mrv2 runs only its built-in architectures, so no Hub code
  is ever run, with it or without it.
- `--tokenizer-mode`: auto / hf (a Hugging Face tokenizer: what mrv2 loads); others refused.
- `--load-format`: auto; safetensors (a model directory); gguf (a GGUF file); others refused.
- `--swap-space`: mrv2 preempts by recompute and keeps no CPU swap: 0 and vLLM's default (4,
  the value scripts copy) say nothing mrv2 does not do; any other value is refused.
- `--hf-overrides`: refused (mrv2's config loader takes no overrides: use --hf-config-path).
- `--enable-chunked-prefill` / `--no-enable-chunked-prefill`: EngineArgs.enable_chunked_prefill
  (off: a prompt is prefilled in one step, and the step budget is at least max_model_len).
- `--distributed-executor-backend` uni | mp: EngineArgs' (ray and external_launcher are refused:
  mrv2's ranks are local processes).
- `--logprobs-mode`: EngineArgs.logprobs_mode (vLLM's four modes).
- `-pp` / `--pipeline-parallel-size`, `-dp` / `--data-parallel-size`: 1, what mrv2 runs (one
  pipeline stage, one engine); other sizes are refused (tensor parallelism is `-tp`).
- `--scheduling-policy`: fcfs, mrv2's scheduler; priority is refused.
- `--runner` generate | pooling, `--convert` embed (the same as --runner pooling) and
  `--pooler-config` JSON ({"pooling_type": "LAST" | "MEAN", "normalize": bool}): EngineArgs'
  runner / convert / pooler_config; a pooling server answers /v1/embeddings, /score, /rerank.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from mrv2.config import ConfigError, ParallelConfig
from mrv2.sampler.logprobs import LOGPROBS_MODES

TOKENIZER_MODES = ("auto", "hf")
LOAD_FORMATS = ("auto", "safetensors", "gguf")
VLLM_SWAP_SPACE_GIB = 4.0
OPTIMIZATION_LEVELS = (0, 1, 2, 3)


def json_or_level(value: str) -> dict[str, Any] | int:
    """`--compilation-config`'s value: a JSON object, or (vLLM's older form) a level 0-3; a
    leading '.' is vLLM's `-cc.key=value` form."""
    if value.startswith(".") and "=" in value:
        key, _, raw = value[1:].partition("=")
        try:
            return {key: json.loads(raw)}
        except ValueError:
            return {key: raw}
    if value.strip().lstrip("-").isdigit():
        return int(value)
    parsed = json.loads(value)
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object or a level, got {value!r}")
    return parsed


class MergeAction(argparse.Action):
    """Repeated `-cc.key=value` (and JSON objects) merge; a level replaces."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        old = getattr(namespace, self.dest, None)
        if isinstance(values, dict) and isinstance(old, dict):
            values = {**old, **values}
        setattr(namespace, self.dest, values)


def split_dotted(argv: list[str]) -> list[str]:
    """vLLM's `-cc.key=value` / `--compilation-config.key=value` as `-cc .key=value`."""
    out = []
    for arg in argv:
        head, dot, rest = arg.partition(".")
        if head in ("-cc", "--compilation-config", "-O") and dot and "=" in rest:
            out += [head, "." + rest]
        else:
            out.append(arg)
    return out


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-O", "--optimization-level", type=json_or_level, default=None,
                        action=MergeAction,
                        help="0: no CUDA graphs; 1-3: mrv2's default CUDA graphs (vLLM's levels; "
                             "mrv2 has no torch.compile)")
    parser.add_argument("--compilation-config", "-cc", type=json_or_level, default=None,
                        action=MergeAction,
                        help='JSON of mrv2.config.CompilationConfig fields, e.g. '
                             '\'{"cudagraph_mode": "FULL"}\' (or a level, as -O)')
    parser.add_argument("--max-logprobs", type=int, default=None,
                        help="the most logprobs a request may ask for (default and most: 20)")
    parser.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction,
                        default=False,
                        help="accepted: mrv2 runs only its built-in architectures, never Hub code")
    parser.add_argument("--tokenizer-mode", default="auto",
                        help="auto or hf (a Hugging Face tokenizer); others are refused")
    parser.add_argument("--load-format", default="auto",
                        help="auto, safetensors (a model directory) or gguf (a GGUF file)")
    parser.add_argument("--swap-space", type=float, default=None,
                        help="no CPU swap in mrv2 (it preempts by recompute): only 0 or vLLM's "
                             "default 4 are accepted")
    parser.add_argument("--hf-overrides", type=json.loads, default=None,
                        help="refused: mrv2 takes no config overrides (use --hf-config-path)")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        default=True, help="prefill long prompts in chunks (default on)")
    parser.add_argument("--distributed-executor-backend", default=None,
                        help="uni (one process) or mp (a process per tensor-parallel rank; "
                             "the default above -tp 1)")
    parser.add_argument("--logprobs-mode", default="raw_logprobs", choices=LOGPROBS_MODES)
    for flag, short in (("--pipeline-parallel-size", "-pp"), ("--data-parallel-size", "-dp")):
        parser.add_argument(flag, short, type=int, default=1,
                            help="only 1: mrv2 runs one pipeline stage and one engine")
    parser.add_argument("--scheduling-policy", default="fcfs",
                        help="fcfs (mrv2's scheduler); priority is not supported")
    parser.add_argument("--runner", default="auto", choices=("auto", "generate", "pooling"),
                        help="pooling: serve embeddings of the model's final hidden states "
                             "(/v1/embeddings, /score, /rerank) instead of generating")
    parser.add_argument("--convert", default="auto", choices=("auto", "none", "embed"),
                        help="embed: the model as an embedding model (as --runner pooling)")
    parser.add_argument("--pooler-config", type=json.loads, default=None,
                        help='JSON, e.g. \'{"pooling_type": "MEAN", "normalize": false}\' '
                             "(default: LAST, normalized; MEAN turns prefix caching off)")


def engine_flag_values(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """The EngineArgs fields these flags set; ValueError naming a refused flag or value."""
    from mrv2.models.gguf import is_gguf_path

    if args.hf_overrides is not None:
        raise ValueError("--hf-overrides is not supported: mrv2's config loader applies no "
                         "overrides; pass --hf-config-path with an edited config.json instead")
    if args.tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(f"--tokenizer-mode {args.tokenizer_mode!r} is not supported: mrv2 "
                         f"loads a Hugging Face tokenizer ({' or '.join(TOKENIZER_MODES)})")
    fmt = args.load_format
    if fmt not in LOAD_FORMATS:
        raise ValueError(f"--load-format {fmt!r} is not supported: mrv2 loads "
                         f"{', '.join(LOAD_FORMATS)}")
    if fmt != "auto" and (fmt == "gguf") != is_gguf_path(model):
        raise ValueError(f"--load-format {fmt!r} does not match the model {model!r} (gguf: a "
                         f".gguf file; safetensors: a model directory or Hub repository)")
    if args.swap_space not in (None, 0, VLLM_SWAP_SPACE_GIB):
        raise ValueError(f"--swap-space {args.swap_space:g} is not supported: mrv2 keeps no CPU "
                         f"swap space (preempted requests are recomputed); leave it unset")
    for flag, size in (("pipeline-parallel-size", args.pipeline_parallel_size),
                       ("data-parallel-size", args.data_parallel_size)):
        if size != 1:
            raise ValueError(f"--{flag} {size} is not supported: mrv2 runs one pipeline stage "
                             f"and one engine (use --tensor-parallel-size to split a model)")
    if args.scheduling_policy != "fcfs":
        raise ValueError(f"--scheduling-policy {args.scheduling_policy!r} is not supported: "
                         f"mrv2 schedules first come, first served (fcfs)")
    backend = args.distributed_executor_backend
    try:  # ParallelConfig's own check, before the server binds or loads anything
        ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                       distributed_executor_backend=backend)
    except ConfigError as error:
        raise ValueError(f"--distributed-executor-backend {backend!r}: {error}") from None
    values: dict[str, Any] = {"compilation_config": compilation_config(args),
                              "enable_chunked_prefill": args.enable_chunked_prefill,
                              "distributed_executor_backend": backend,
                              "logprobs_mode": args.logprobs_mode,
                              "runner": args.runner, "convert": args.convert,
                              "pooler_config": args.pooler_config}
    if args.max_logprobs is not None:
        values["max_logprobs"] = args.max_logprobs
    return values


def compilation_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """EngineArgs.compilation_config of -O and --compilation-config (its fields win)."""
    level, config = args.optimization_level, args.compilation_config
    if isinstance(config, int):  # vLLM's `--compilation-config 3`: a level
        level, config = config, None
    merged: dict[str, Any] = {}
    if isinstance(level, dict):  # -O.key=value
        merged.update(level)
    elif level is not None:
        if level not in OPTIMIZATION_LEVELS:
            raise ValueError(f"-O / --optimization-level {level} is not a level (0-3)")
        if level == 0:
            merged["cudagraph_mode"] = "NONE"
    merged.update(config or {})
    return merged or None
