"""vLLM's engine-side `serve` flags beyond mrv2's own. Each flag's dest is an EngineArgs field,
so its value reaches EngineArgs whole (cli_args.engine_args_from) and EngineArgs' own checks
honour it or refuse it with a ConfigError naming it (mrv2/engine/engine_args_checks.py):
`LLM(...)` and `mrv2 serve` take the same values. None is accepted and ignored.

- `-O` / `--optimization-level` N, `--compilation-config` / `-cc` JSON (or a level): mrv2 has no
  torch.compile, only CUDA graphs (mrv2.config.CompilationConfig). -O0 turns them off (vLLM's
  O0: no cudagraphs); -O1..3 keep mrv2's default mode. Explicit `--compilation-config` fields win
  over the level, as in vLLM. A field mrv2 lacks is refused by EngineArgs, naming it.
- `--max-logprobs`: EngineArgs.max_logprobs (the server checks requests against it too).
- `--trust-remote-code` (a permission: no Hub code ever runs in mrv2), `--tokenizer-mode` auto |
  hf, `--load-format` auto | safetensors | gguf, `--swap-space` 0 | 4, `--hf-overrides` (none),
  `--scheduling-policy` fcfs: what engine_args_checks.py takes; other values are refused.
  `-pp` / `--pipeline-parallel-size`, `-dp` / `--data-parallel-size`: ParallelConfig's.
- `--enable-chunked-prefill` / `--no-enable-chunked-prefill`: EngineArgs.enable_chunked_prefill
  (off: a prompt is prefilled in one step, and the step budget is at least max_model_len).
- `--distributed-executor-backend` uni | mp | ray: EngineArgs' (ray: the ranks as actors on a
  Ray cluster, the `ray` extra; external_launcher is refused).
- `--logprobs-mode`: EngineArgs.logprobs_mode (vLLM's four modes).
- `--batch-invariant`: EngineArgs.batch_invariant (mrv2/batch_invariant.py; vLLM has it as the
  VLLM_BATCH_INVARIANT environment variable).
- `--runner` generate | pooling, `--convert` embed (the same as --runner pooling) and
  `--pooler-config` JSON ({"pooling_type": "LAST" | "MEAN", "normalize": bool}): EngineArgs'
  runner / convert / pooler_config; a pooling server answers /v1/embeddings, /score, /rerank.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from mrv2.sampler.logprobs import LOGPROBS_MODES


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
                        help="only {} (nothing): mrv2 takes no config overrides (use "
                             "--hf-config-path)")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        default=True, help="prefill long prompts in chunks (default on)")
    parser.add_argument("--distributed-executor-backend", default=None,
                        help="uni (one process), mp (a process per tensor-parallel rank; "
                             "the default above -tp 1) or ray (a Ray actor per rank)")
    parser.add_argument("--logprobs-mode", default="raw_logprobs", choices=LOGPROBS_MODES)
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction,
                        default=None, help="a request's tokens and logprobs the same bits "
                        "whatever its batch (default: MRV2_BATCH_INVARIANT=1 turns it on)")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="pipeline stages, each a run of the layers (times -tp ranks)")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="engine cores behind the server, each with the whole model; "
                             "requests go to the least loaded")
    parser.add_argument("--data-parallel-backend", "-dpb", default="mp", choices=("mp", "ray"),
                        help="mp (each engine core a process of this machine) or ray (a Ray "
                             "actor on the cluster)")
    parser.add_argument("--scheduling-policy", default="fcfs",
                        help="fcfs (mrv2's scheduler); priority is not supported")
    parser.add_argument("--runner", default="auto", choices=("auto", "generate", "pooling"),
                        help="pooling: serve embeddings of the model's final hidden states "
                             "(/v1/embeddings, /score, /rerank) instead of generating")
    parser.add_argument("--convert", default="auto", choices=("auto", "none", "embed"),
                        help="embed: the model as an embedding model (as --runner pooling)")
    parser.add_argument("--speculative-config", "-sc", type=json.loads, default=None,
                        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                             "(methods: ngram, suffix)")
    parser.add_argument("--pooler-config", type=json.loads, default=None,
                        help='JSON, e.g. \'{"pooling_type": "MEAN", "normalize": false}\' '
                             "(default: LAST, normalized; MEAN turns prefix caching off)")


def engine_flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineArgs fields whose flags do not parse to the field's value as it is: -O's
    `-O.key=value` form (compilation config fields) and an unset --max-logprobs (the field's
    default). EngineArgs checks the values, refusing by name the ones mrv2 does not take."""
    from mrv2.sampling_params import MAX_LOGPROBS

    level, config = args.optimization_level, args.compilation_config
    if isinstance(level, dict):  # -O.key=value: compilation config fields, the config's winning
        level, config = None, ({**level, **config} if isinstance(config, dict) else
                               level if config is None else config)
    return {"optimization_level": level, "compilation_config": config,
            "max_logprobs": MAX_LOGPROBS if args.max_logprobs is None else args.max_logprobs}
