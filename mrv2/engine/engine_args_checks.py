"""EngineArgs' checks of vLLM's engine options that mrv2 takes as they are, without a config of
their own: permissions and no-ops (`trust_remote_code`, `tokenizer_mode`, `load_format`,
`swap_space`, ...), the front end's generation-config fields, and the refusal by name of a vLLM
option mrv2 does not implement. `EngineArgs(...)` (so `LLM(...)`) and `mrv2 serve`'s flags
(which become an EngineArgs) pass through the same checks, so both accept the same values and
refuse the others with the same error.

- `trust_remote_code`: a permission. mrv2 runs only its built-in architectures, so no Hub code
  is ever run, with it or without it.
- `tokenizer_mode`: auto / hf (a Hugging Face tokenizer: what mrv2 loads); others refused.
- `load_format`: auto; safetensors (a model directory); gguf (a GGUF file); others refused.
- `swap_space`: mrv2 preempts by recompute and keeps no CPU swap: 0 and vLLM's default (4, the
  value scripts copy) say nothing mrv2 does not do; any other value is refused.
- `hf_overrides`: none (or an empty dict, vLLM's LLM default); mrv2's config loader takes no
  overrides (use `hf_config_path`).
- `optimization_level` 0-3 (vLLM's -O; `compilation_config` as an int is the same level): mrv2
  has no torch.compile, only CUDA graphs. 0 turns them off; 1-3 keep mrv2's default mode;
  explicit `compilation_config` fields win over the level, as in vLLM.
- `pipeline_parallel_size`, `data_parallel_size`: ParallelConfig's (the offline LLM runs one
  engine: data parallelism is the server's).
- `scheduling_policy`: fcfs, mrv2's scheduler; priority is refused.
- `generation_config`, `override_generation_config`: which generation_config.json gives the
  default sampling parameters, and fields over it (mrv2/entrypoints/openai/generation_config.py).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from mrv2.config import ConfigError
from mrv2.entrypoints.openai.vllm_serve_options import vllm_option_group
from mrv2.models.gguf import is_gguf_path

if TYPE_CHECKING:
    from mrv2.engine.arg_utils import EngineArgs

_Class = TypeVar("_Class", bound=type)

TOKENIZER_MODES = ("auto", "hf")
LOAD_FORMATS = ("auto", "safetensors", "gguf")
VLLM_SWAP_SPACE_GIB = 4.0
OPTIMIZATION_LEVELS = (0, 1, 2, 3)
# vLLM's LLM / EngineArgs keywords of earlier releases, gone from the `vllm serve` options of
# vllm_serve_options.py, that scripts still pass: refused by name as those are.
VLLM_EARLIER_ENGINE_ARGS = ("task", "max_seq_len_to_capture", "disable_async_output_proc",
                            "override_pooler_config", "guided_decoding_backend",
                            "use_v2_block_manager")
# `vllm serve`'s HTTP options are not vLLM engine arguments either: a plain TypeError.
_SERVER_GROUPS = ("Frontend",)


class UnimplementedOptionError(ConfigError, TypeError):
    """A keyword argument that vLLM's LLM / EngineArgs takes and mrv2 does not implement (a
    TypeError too, as an unknown keyword argument is)."""


def refuse_unimplemented(cls: type, kwargs: Mapping[str, Any]) -> None:
    """UnimplementedOptionError naming the first of `kwargs` that is not a field of `cls` and is
    one of vLLM's engine options; other unknown keywords are left to the TypeError of `cls`."""
    fields = getattr(cls, "__dataclass_fields__", {})
    for name in kwargs:
        if name in fields:
            continue
        flag = "--" + name.replace("_", "-")
        group = vllm_option_group(flag)
        if group is None and name in VLLM_EARLIER_ENGINE_ARGS:
            group = "an earlier vLLM's"
        if group is not None and group not in _SERVER_GROUPS:
            raise UnimplementedOptionError(
                f"{name}={kwargs[name]!r}: mrv2 does not implement vLLM's {name} ({flag}, "
                f"{group} option); leave it out (`mrv2 serve --help` lists the engine options "
                f"mrv2 takes)")


def refusing_unimplemented(cls: _Class) -> _Class:
    """Class decorator of a dataclass: its constructor calls `refuse_unimplemented` before the
    dataclass' own __init__ (whose signature it keeps)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse_unimplemented(cls, kwargs)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def refuse(field: str, value: Any, why: str) -> ConfigError:
    """The error of a refused value, naming the field and its `mrv2 serve` flag."""
    return ConfigError(f"{field}={value!r} (--{field.replace('_', '-')}) is not supported: {why}")


def check_vllm_options(args: EngineArgs) -> None:
    """ConfigError (or the generation config's ValueError) naming the first field of `args`
    whose value mrv2 refuses (the module's docstring says which values are taken)."""
    from mrv2.entrypoints.openai.generation_config import check_mode

    if not isinstance(args.trust_remote_code, bool):
        raise refuse("trust_remote_code", args.trust_remote_code, "give True or False")
    if args.tokenizer_mode not in TOKENIZER_MODES:
        raise refuse("tokenizer_mode", args.tokenizer_mode, f"mrv2 loads a Hugging Face "
                     f"tokenizer ({' or '.join(map(repr, TOKENIZER_MODES))})")
    fmt = args.load_format
    if fmt not in LOAD_FORMATS:
        raise refuse("load_format", fmt, f"mrv2 loads {', '.join(map(repr, LOAD_FORMATS))}")
    if fmt != "auto" and (fmt == "gguf") != is_gguf_path(args.model):
        raise refuse("load_format", fmt, f"it does not match the model {args.model!r} (gguf: a "
                     f".gguf file; safetensors: a model directory or Hub repository)")
    if args.swap_space not in (None, 0, VLLM_SWAP_SPACE_GIB):
        raise refuse("swap_space", args.swap_space, "mrv2 keeps no CPU swap space (preempted "
                     "requests are recomputed); leave it unset (or 0)")
    if args.hf_overrides is not None and args.hf_overrides != {}:
        raise refuse("hf_overrides", args.hf_overrides, "mrv2's config loader applies no "
                     "overrides; pass hf_config_path with an edited config.json instead")
    check_optimization_level("optimization_level", args.optimization_level)
    if isinstance(args.compilation_config, int) and not isinstance(args.compilation_config, bool):
        check_optimization_level("compilation_config", args.compilation_config)  # a level
    if args.scheduling_policy != "fcfs":
        raise refuse("scheduling_policy", args.scheduling_policy,
                     "mrv2 schedules first come, first served ('fcfs')")
    check_mode(args.generation_config)
    check_generation_overrides(args.override_generation_config)


def check_optimization_level(field: str, level: Any) -> None:
    if level is not None and (isinstance(level, bool) or level not in OPTIMIZATION_LEVELS):
        raise refuse(field, level, "vLLM's optimization levels are 0-3 (0: no CUDA graphs; mrv2 "
                     "has no torch.compile)")


def check_generation_overrides(value: Any) -> dict[str, Any]:
    """override_generation_config (--override-generation-config): the generation-config fields
    mrv2 takes defaults from (others would be ignored, so they are refused), as a dict."""
    from mrv2.models.generation_config import SAMPLING_FIELDS, sampling_defaults

    if value is None:
        return {}
    if not isinstance(value, dict):
        raise refuse("override_generation_config", value, "give a dict (a JSON object)")
    unknown = sorted(set(value) - set(SAMPLING_FIELDS))
    if unknown:
        raise refuse("override_generation_config", value, f"mrv2 takes no default from "
                     f"{', '.join(unknown)} (it reads {', '.join(SAMPLING_FIELDS)})")
    numbers = sampling_defaults(value)  # by SamplingParams name (max_new_tokens: max_tokens)
    wrong = sorted(name for name in value if SAMPLING_FIELDS[name] not in numbers)
    if wrong:
        raise refuse("override_generation_config", value, f"{', '.join(wrong)} must be numbers")
    return dict(value)
