"""EngineArgs: the user's flat keyword arguments, validated into one frozen EngineConfig.

Everything is checked here, before any weight is read: a bad path, an unsupported
architecture or an out-of-range value raises a `ValueError` subclass naming the value.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import TypeVar

from mrv2 import platform
from mrv2.config import (RUNNER_TYPES, CacheConfig, CompilationConfig, ConfigError, EngineConfig,
                         ModelConfig, ParallelConfig, PoolerConfig, SchedulerConfig,
                         StructuredOutputsConfig, check_logprobs_mode)
from mrv2.core.kv_cache_layout import recurrent_layers
from mrv2.engine.engine_args_checks import check_vllm_options, refusing_unimplemented
from mrv2.engine.engine_args_flags import add_engine_args_flags
from mrv2.models.gguf import (GGUFError, has_compact_linears, has_tokenizer, is_gguf_path,
                              open_gguf)
from mrv2.models.hub import resolve_model_path
from mrv2.models.loader import cpu_auto_gguf, load_hf_config, resolve_dtype, split_cpu_dtype
from mrv2.sampling_params import MAX_LOGPROBS
from mrv2.spec_decode.config import SpeculativeConfig, check_draft_model, eagle3_target

DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096
BATCH_INVARIANT_ENV = "MRV2_BATCH_INVARIANT"
_Parser = TypeVar("_Parser", argparse.ArgumentParser, argparse._ArgumentGroup)
# vLLM's --convert values mrv2 takes: a decoder becomes an embedding model with "embed".
CONVERT_TYPES = ("auto", "none", "embed")

logger = logging.getLogger(__name__)


@refusing_unimplemented  # a vLLM option mrv2 lacks: refused by name, not a bare TypeError
@dataclass
class EngineArgs:
    # A local model directory or GGUF file, a Hub id ("org/name"), or a GGUF file in a Hub
    # repo ("org/name/file.gguf"); mrv2/models/hub.py resolves it.
    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    seed: int = 0
    kv_cache_memory_gb: float | None = None
    tensor_parallel_size: int = 1
    # None: on, except with MEAN pooling (it computes every prompt token) or recurrent layers.
    enable_prefix_caching: bool | None = None
    enforce_eager: bool = False
    # None: on, except with speculative decoding (a request's next step waits for its drafts) and
    # in one CPU process (a step's calls return with its work done: nothing would overlap).
    async_scheduling: bool | None = None
    # vLLM's --num-scheduler-steps: decode steps one scheduled step may run (SchedulerConfig;
    # None: the engine's choice, several while no request streams).
    num_scheduler_steps: int | None = None
    # vLLM's: prompts longer than the step's token budget are prefilled in chunks. Off, a
    # prompt is scheduled whole, so the budget defaults to at least max_model_len (vLLM's rule).
    enable_chunked_prefill: bool = True
    # None: "uni" for tensor_parallel_size=1, "mp" (one worker process per rank) above.
    distributed_executor_backend: str | None = None
    # vLLM's: each tensor-parallel rank holds whole experts, 1/tp of them, instead of 1/tp of
    # every expert (ParallelConfig; a no-op at tp 1 and for a model without experts).
    enable_expert_parallel: bool = False
    # vLLM's spelling: a dict of CompilationConfig fields, a CompilationConfig, or (vLLM's older
    # form) an optimization level, as `optimization_level`.
    compilation_config: dict | CompilationConfig | int | None = None
    device: str | None = None
    # "raw_logprobs" | "processed_logprobs" | "raw_logits" | "processed_logits" (vLLM's).
    logprobs_mode: str = "raw_logprobs"
    # A tokenizer directory or Hub id that replaces the model's own (vLLM's --tokenizer).
    tokenizer: str | None = None
    # A directory or Hub id whose config.json replaces the model's config (a GGUF file's).
    hf_config_path: str | None = None
    # Hub revision (branch, tag or commit) of the model, and of the tokenizer (default: the
    # model's); the Hub cache directory (vLLM's --download-dir).
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    # vLLM's memory knobs. On CUDA the KV cache gets `gpu_memory_utilization` of the device's
    # memory minus weights and the profiled step peak; on the CPU it does not apply (a warning
    # says so) and the budget is `kv_cache_memory_bytes` / `kv_cache_memory_gb`, or 4 GiB.
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    # vLLM's: the KV cache's element type, "auto" (the model's dtype), "bfloat16" or "float16"
    # (half the memory and bytes attention reads; attention computes in the model's dtype).
    kv_cache_dtype: str = "auto"
    # vLLM's `quantization`. "gguf": compute on a quantized GGUF file's blocks (CPU only;
    # resident weights near the file size). None: with dtype="auto" on the CPU, as
    # loader.cpu_auto_gguf decides (the blocks, with bfloat16 and int8 copies for many rows
    # where the CPU picks bfloat16), else dequantized; a dtype given by name dequantizes.
    quantization: str | None = None
    # vLLM's: StructuredOutputsConfig fields (or one), and --reasoning-parser (its parser).
    structured_outputs_config: dict | StructuredOutputsConfig | None = None
    reasoning_parser: str | None = None
    # vLLM's: the most (prompt) logprobs a request may ask for; at most MAX_LOGPROBS (mrv2's).
    max_logprobs: int = MAX_LOGPROBS
    # vLLM's: "pooling" (or convert="embed") serves embeddings of the decoder's final hidden
    # states (LLM.embed, /v1/embeddings); "auto" is "generate" for the causal LMs mrv2 runs.
    # pooler_config: a dict of PoolerConfig fields (or one); default LAST, normalised.
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: dict | PoolerConfig | None = None
    # Batch-invariant mode (mrv2/batch_invariant.py; vLLM's VLLM_BATCH_INVARIANT): a request's
    # tokens and logprobs do not depend on its batch. None: MRV2_BATCH_INVARIANT=1 turns it on.
    batch_invariant: bool | None = None
    # vLLM's: a dict of SpeculativeConfig fields (mrv2/spec_decode/config.py); None: off.
    speculative_config: dict | SpeculativeConfig | None = None
    # vLLM's options that mrv2 takes as permissions or no-ops, each checked (the values mrv2
    # refuses raise ConfigError): mrv2/engine/engine_args_checks.py.
    trust_remote_code: bool = False
    tokenizer_mode: str = "auto"
    load_format: str = "auto"
    swap_space: float | None = None
    hf_overrides: dict | None = None
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_backend: str = "mp"
    scheduling_policy: str = "fcfs"
    # vLLM's -O: 0 turns CUDA graphs off, 1-3 keep mrv2's default graphs (mrv2 has no
    # torch.compile); compilation_config's explicit fields win over it.
    optimization_level: int | None = None
    # vLLM's generation-config options, read by the front ends (LLM, the server) for their
    # default sampling parameters: "auto" (the model's generation_config.json), "vllm" (none)
    # or a folder holding one; and a dict of its fields over it.
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # vLLM's: no periodic stats log (the server's follows it); LLM passes True, as vLLM's.
    disable_log_stats: bool = False

    def __post_init__(self) -> None:
        # Cheap checks at once (the server's flags go through them before it binds its port).
        check_vllm_options(self)
        self._parallel_config()

    def _parallel_config(self) -> ParallelConfig:
        # Every ParallelConfig field is an EngineArgs field of the same name.
        return ParallelConfig(**{f.name: getattr(self, f.name)
                                 for f in dataclasses.fields(ParallelConfig)})

    @classmethod
    def add_cli_args(cls, parser: _Parser) -> _Parser:
        """vLLM's: a flag per field (`--max-model-len`, `--no-enable-prefix-caching`, JSON for
        the config dicts), each parsing to the field's value, so a vLLM script's
        `LLM(**vars(parser.parse_args()))` works. Returns the parser (or argument group)."""
        add_engine_args_flags(parser, cls)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """vLLM's: the fields of `add_cli_args`' flags from a parsed namespace."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def create_engine_config(self) -> EngineConfig:
        device = self.device or platform.device_type()
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"device={device!r}: expected 'cpu' or 'cuda'")
        # Cheap checks first, so they fail before the model directory is touched.
        check_logprobs_mode(self.logprobs_mode)
        runner, pooler_config = self._runner()
        if (isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int)
                or not 0 <= self.max_logprobs <= MAX_LOGPROBS):
            raise ConfigError(f"max_logprobs={self.max_logprobs!r}: mrv2 returns at most "
                              f"{MAX_LOGPROBS} logprobs per position (its sampler's cap); give "
                              f"a value in [0, {MAX_LOGPROBS}] (-1, the whole vocabulary, is not "
                              f"supported)")
        caching = (getattr(pooler_config, "pooling_type", None) != "MEAN"
                   if self.enable_prefix_caching is None else self.enable_prefix_caching)
        cache_config = CacheConfig(block_size=self.block_size,
                                   kv_cache_memory_gb=self._kv_cache_memory_gb(),
                                   enable_prefix_caching=caching,
                                   gpu_memory_utilization=self._gpu_memory_utilization(device),
                                   cache_dtype=self.kv_cache_dtype)
        parallel_config = self._parallel_config()
        model_path, tokenizer_path, hf_config_path = self._resolve_paths()
        hf_config = load_hf_config(model_path, hf_config_path)
        hybrid = recurrent_layers(hf_config) is not None
        if hybrid and self.enable_prefix_caching is None:
            cache_config = dataclasses.replace(cache_config, enable_prefix_caching=False)
        model_max_len = _derived_max_model_len(hf_config)
        max_model_len = model_max_len if self.max_model_len is None else self.max_model_len
        if max_model_len < 1:
            raise ConfigError(f"max_model_len={max_model_len} must be at least 1")
        if max_model_len > model_max_len:
            raise ConfigError(f"max_model_len={max_model_len} is larger than the model's "
                              f"maximum context of {model_max_len} tokens")
        dtype, cpu_weight_dtype = split_cpu_dtype(resolve_dtype(self.dtype, hf_config, device),
                                                  device)
        batch_invariant = (os.environ.get(BATCH_INVARIANT_ENV, "0") == "1"
                           if self.batch_invariant is None else self.batch_invariant)
        quantization, copies, int8 = self._quantization(model_path, device, batch_invariant)
        model_config = ModelConfig(model=model_path, tokenizer=tokenizer_path, dtype=dtype,
                                   cpu_weight_dtype=cpu_weight_dtype, gguf_bf16_copies=copies,
                                   gguf_int8_prefill=int8,
                                   max_model_len=max_model_len, seed=self.seed,
                                   hf_config=hf_config, logprobs_mode=self.logprobs_mode,
                                   quantization=quantization, runner=runner,
                                   pooler_config=pooler_config, batch_invariant=batch_invariant)
        max_tokens = self.max_num_batched_tokens
        if max_tokens is None:
            max_tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs,
                             0 if self.enable_chunked_prefill else max_model_len)
        speculative_config = self._speculative_config(runner, device, model_config)
        model_config = eagle3_target(speculative_config, model_config)
        auto_async = speculative_config is None and (device != "cpu"
                                                     or parallel_config.world_size > 1)
        scheduler_config = SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                           max_num_batched_tokens=max_tokens,
                                           enable_chunked_prefill=self.enable_chunked_prefill,
                                           async_scheduling=(auto_async if self.async_scheduling
                                                             is None else self.async_scheduling),
                                           num_scheduler_steps=self._num_scheduler_steps())
        # No graph holds stages' hand-overs or (yet) a hybrid model's recurrent layers.
        compilation_config = self._compilation_config().resolve(
            device, max_tokens, self.max_num_seqs,
            enforce_eager=self.enforce_eager or self.pipeline_parallel_size > 1 or hybrid)
        return EngineConfig(model_config=model_config, cache_config=cache_config,
                            scheduler_config=scheduler_config, parallel_config=parallel_config,
                            compilation_config=compilation_config, device=device,
                            structured_outputs_config=self._structured_outputs_config(),
                            speculative_config=speculative_config)

    def _num_scheduler_steps(self) -> int | None:
        """As given; under pipeline stages None (auto: runs of several) is one step."""
        if self.num_scheduler_steps is None and self.pipeline_parallel_size > 1:
            return 1
        return self.num_scheduler_steps

    def _speculative_config(self, runner: str, device: str, target: ModelConfig
                            ) -> SpeculativeConfig | None:
        config = SpeculativeConfig.from_value(self.speculative_config)
        if config is None:
            return None
        if device != "cpu":
            raise ConfigError("speculative decoding runs on the CPU in mrv2 so far (its verify "
                              "rows' input preparation has no Triton kernel yet)")
        if runner == "pooling":
            raise ConfigError("speculative_config applies to generation, not runner='pooling'")
        if self.num_scheduler_steps not in (None, 1):
            raise ConfigError(f"speculative_config with num_scheduler_steps="
                              f"{self.num_scheduler_steps}: a verify step is one step; leave "
                              f"num_scheduler_steps unset (or 1)")
        if config.model is not None and config.draft_model_config is None:
            draft = self._draft_model_config(config, target)
            config = dataclasses.replace(config, draft_model_config=draft)
        return config

    def _draft_model_config(self, spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
        """The draft model's config: its checkpoint resolved as the target's is, in the
        target's dtype and max_model_len, with the target's tokenizer."""
        if self.tensor_parallel_size > 1:
            raise ConfigError(f"speculative_config.method={spec.method!r} with "
                              f"tensor_parallel_size > 1 is not implemented in mrv2")
        args = dataclasses.replace(
            self, model=spec.model, revision=spec.revision, quantization=spec.quantization,
            tokenizer=target.tokenizer_path, hf_config_path=None, hf_overrides=None,
            max_model_len=target.max_model_len, speculative_config=None)
        try:
            draft = args.create_engine_config().model_config
        except ConfigError as error:
            raise ConfigError(f"speculative_config.model={spec.model!r}: {error}") from None
        check_draft_model(draft, target, spec.method)
        return draft

    def _resolve_paths(self) -> tuple[str, str | None, str | None]:
        """Local paths of the model, the tokenizer (None: the model's) and the config override
        (None: the model's), Hub ids downloaded; a GGUF file without a tokenizer needs one."""
        def resolve(name: str, revision: str | None, what: str) -> str:
            return resolve_model_path(str(name), revision=revision,
                                      download_dir=self.download_dir, what=what)

        model = resolve(self.model, self.revision, "model")
        tokenizer = config = None
        if self.tokenizer is not None:
            tokenizer = resolve(self.tokenizer, self.tokenizer_revision or self.revision,
                                "tokenizer")
        if self.hf_config_path is not None:
            config = resolve(self.hf_config_path, self.revision, "tokenizer")
        if tokenizer is None and is_gguf_path(model) and not has_tokenizer(open_gguf(model)):
            raise GGUFError(f"{model}: the file holds no tokenizer; pass one with "
                            f"tokenizer= / --tokenizer (a directory or Hub id)")
        return model, tokenizer, config

    def _runner(self) -> tuple[str, PoolerConfig | None]:
        """The runner of runner / convert (vLLM's flags) and its pooler config."""
        if self.runner not in ("auto", *RUNNER_TYPES):
            raise ConfigError(f"runner={self.runner!r}: expected 'auto', "
                              f"{' or '.join(map(repr, RUNNER_TYPES))}")
        if self.convert not in CONVERT_TYPES:
            raise ConfigError(f"convert={self.convert!r}: mrv2 converts a decoder to 'embed' "
                              f"only (expected one of {', '.join(CONVERT_TYPES)})")
        runner = self.runner
        if self.convert == "embed":
            if runner == "generate":
                raise ConfigError("convert='embed' makes a pooling model, not runner='generate'")
            runner = "pooling"
        elif runner == "pooling" and self.convert == "none":
            raise ConfigError("runner='pooling' pools a decoder converted with convert='embed' "
                              "(or 'auto'), not convert='none'")
        elif runner == "auto":
            runner = "generate"  # what a causal LM does
        value = self.pooler_config
        if isinstance(value, dict):
            try:
                value = PoolerConfig(**value)
            except TypeError as error:
                raise ConfigError(f"pooler_config={self.pooler_config!r}: {error} (mrv2 takes "
                                  f"pooling_type and normalize)") from None
        elif value is not None and not isinstance(value, PoolerConfig):
            raise ConfigError(f"pooler_config must be a dict or PoolerConfig, got "
                              f"{type(value).__name__}")
        if runner == "pooling" and value is None:
            value = PoolerConfig()
        return runner, value

    def _kv_cache_memory_gb(self) -> float | None:
        if self.kv_cache_memory_bytes is None:
            return self.kv_cache_memory_gb
        if self.kv_cache_memory_gb is not None:
            raise ConfigError("give kv_cache_memory_bytes or kv_cache_memory_gb, not both")
        if isinstance(self.kv_cache_memory_bytes, bool) or self.kv_cache_memory_bytes <= 0:
            raise ConfigError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes!r} must be "
                              f"a positive number of bytes")
        return self.kv_cache_memory_bytes / (1 << 30)

    def _gpu_memory_utilization(self, device: str) -> float:
        value = self.gpu_memory_utilization
        if value is None:
            return platform.DEFAULT_GPU_MEMORY_UTILIZATION
        if device != "cuda":
            logger.warning("gpu_memory_utilization=%s does not apply on the %s: the KV cache "
                           "is sized by kv_cache_memory_bytes (default %s GiB)", value, device,
                           platform.DEFAULT_CPU_KV_CACHE_GB)
        return value

    def _quantization(self, model_path: str, device: str, batch_invariant: bool
                      ) -> tuple[str | None, bool, bool]:  # (it, ModelConfig.gguf_*)
        if self.quantization not in (None, "gguf"):
            raise ConfigError(f"quantization={self.quantization!r} is not supported; mrv2 "
                              f"implements 'gguf' (a GGUF file's quantized weights, on CPU)")

        def has_blocks() -> bool:
            return is_gguf_path(model_path) and has_compact_linears(open_gguf(model_path))

        if self.quantization is None:
            auto = device == "cpu" and str(self.dtype).lower() == "auto" and has_blocks()
            found = cpu_auto_gguf(model_path, batch_invariant) if auto else (False,) * 3
            return ("gguf" if found[0] else None), found[1], found[2]
        if not has_blocks():
            raise ConfigError(f"quantization='gguf' needs a GGUF file whose weights are "
                              f"stored quantized or in 16 bits; {model_path} is not one")
        if device != "cpu":
            raise ConfigError("quantization='gguf' runs on the CPU only (the CUDA path "
                              "dequantizes GGUF weights: leave quantization unset)")
        return self.quantization, False, False

    def _structured_outputs_config(self) -> StructuredOutputsConfig:
        value = self.structured_outputs_config
        if isinstance(value, StructuredOutputsConfig):
            config = value
        elif value is None or isinstance(value, dict):
            try:
                config = StructuredOutputsConfig(**(value or {}))
            except TypeError as error:
                raise ConfigError(f"structured_outputs_config={value!r}: {error}") from None
        else:
            raise ConfigError(f"structured_outputs_config must be a dict or "
                              f"StructuredOutputsConfig, got {type(value).__name__}")
        if self.reasoning_parser:
            config = dataclasses.replace(config, reasoning_parser=self.reasoning_parser)
        return config

    def _compilation_config(self) -> CompilationConfig:
        value, level = self.compilation_config, self.optimization_level
        if isinstance(value, int) and not isinstance(value, bool):  # vLLM's older form: a level
            value, level = None, value
        if isinstance(value, CompilationConfig):
            return value
        if value is None or isinstance(value, dict):
            fields = {"cudagraph_mode": "NONE"} if level == 0 else {}  # -O0: no CUDA graphs
            try:
                return CompilationConfig(**{**fields, **(value or {})})
            except TypeError as error:
                raise ConfigError(f"compilation_config={value!r}: {error}") from None
        raise ConfigError(f"compilation_config must be a dict, a CompilationConfig or an "
                          f"optimization level, got {type(value).__name__}")


def _derived_max_model_len(hf_config) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ConfigError("the model config gives no maximum context length "
                      "(max_position_embeddings); pass max_model_len")
