"""Frozen engine configuration. One `EngineConfig` is passed whole to every component.

Values are validated when built by `EngineArgs.create_engine_config()`; derived values are
properties so that they never disagree with the fields they come from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from mrv2.core.kv_cache_layout import KVCacheLayout
from mrv2.errors import ConfigError
from mrv2.parallel_config import ParallelConfig

if TYPE_CHECKING:  # spec_decode/config.py imports this module
    from mrv2.spec_decode.config import SpeculativeConfig


def check_logprobs_mode(mode: str) -> None:
    """ConfigError naming the allowed values unless `mode` is a logprobs_mode."""
    from mrv2.sampler.logprobs import LOGPROBS_MODES  # the sampler defines what it computes

    if mode not in LOGPROBS_MODES:
        raise ConfigError(f"logprobs_mode={mode!r} is invalid: expected one of "
                          f"{', '.join(LOGPROBS_MODES)}")


# vLLM's names of the quantization methods mrv2 implements (None: unquantized).
QUANTIZATION_METHODS = (None, "gguf")
# What the engine does with a prompt: generate tokens, or pool its hidden states (vLLM's
# runner types); and the poolings mrv2 implements (vLLM's names).
RUNNER_TYPES = ("generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN")
# Decode steps a scheduled step runs by default while no request streams (bench/README.md).
AUTO_DECODE_STEPS = 8


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's pooler config of a decoder converted to embedding: the hidden states after the
    final norm (what the forward returns, before the LM head) of the last prompt token (LAST)
    or their mean over the prompt (MEAN), L2-normalised unless `normalize` is False (a
    request's PoolingParams.normalize wins). vLLM's defaults for a causal LM: LAST, normalised.
    """

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        kind = self.pooling_type.upper() if isinstance(self.pooling_type, str) else None
        if kind not in POOLING_TYPES:
            raise ConfigError(f"pooler_config.pooling_type={self.pooling_type!r}: mrv2 pools "
                              f"{' or '.join(POOLING_TYPES)}")
        object.__setattr__(self, "pooling_type", kind)
        if not isinstance(self.normalize, bool):
            raise ConfigError(f"pooler_config.normalize={self.normalize!r} must be a boolean")


@dataclass(frozen=True)
class ModelConfig:
    # A local Hugging Face model directory or GGUF file (Hub ids are resolved to one first).
    model: str
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    # Where the tokenizer comes from (a directory or GGUF file); None: the model.
    tokenizer: str | None = None
    # transformers PretrainedConfig, read through AutoConfig. Not compared or printed.
    hf_config: Any = field(default=None, compare=False, repr=False)
    # What sample logprobs report (vLLM's names): "raw_logprobs" (the model's logits, before
    # any processing), "processed_logprobs" (after bias, penalties, temperature and the
    # filters: the distribution the token was drawn from), or the "*_logits" variants.
    logprobs_mode: str = "raw_logprobs"
    # "gguf": the linears compute on the GGUF file's quantized blocks (CPU); None: `dtype`'s.
    quantization: str | None = None
    # CPU only: the linears, the embedding and the LM head keep their weights in this 16-bit
    # dtype and the rest computes in `dtype` (float32): a bfloat16 / float16 model on the CPU
    # (loader.split_cpu_dtype). None: weights of `dtype`. Under quantization="gguf" the
    # weights stay as the file stores them; bfloat16 here runs their prefill in bfloat16.
    cpu_weight_dtype: torch.dtype | None = None
    # Under quantization="gguf" with cpu_weight_dtype bfloat16: each linear of integer blocks
    # (or F16) also holds its weight dequantized to bfloat16, which its plan runs from a few
    # rows on (linear_plan.with_bf16_copy). EngineArgs sets it for a GGUF file at the defaults
    # on a CPU that multiplies bfloat16 natively (loader.cpu_auto_gguf).
    gguf_bf16_copies: bool = False
    # With gguf_bf16_copies: each decoder layer's linear of integer blocks also holds an int8
    # copy, on which a prompt's rows run (linear_plan.with_int8_products; int8_linear.py has
    # its error bound). EngineArgs sets it where oneDNN multiplies int8 on VNNI
    # (loader.cpu_auto_gguf), unless MRV2_GGUF_PREFILL=bf16.
    gguf_int8_prefill: bool = False
    # "pooling": every request is a prompt whose pooled hidden states are the result
    # (LLM.embed); `pooler_config` says how (a default one for "pooling", None otherwise).
    runner: str = "generate"
    pooler_config: PoolerConfig | None = None
    batch_invariant: bool = False  # mrv2/batch_invariant.py: set in the worker before it loads
    # An EAGLE-3 head's target: the layers whose input (the residual stream entering them) the
    # model also outputs, concatenated, as the head's features (models/llama.py; () none).
    aux_hidden_state_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_logprobs_mode(self.logprobs_mode)
        if self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(f"quantization={self.quantization!r}: expected one of "
                              f"{', '.join(map(repr, QUANTIZATION_METHODS))}")
        if self.gguf_bf16_copies and (self.quantization != "gguf"
                                      or self.cpu_weight_dtype != torch.bfloat16):
            raise ConfigError("gguf_bf16_copies: bfloat16 copies serve a GGUF file's blocks "
                              "(quantization='gguf') in a bfloat16 model on the CPU")
        if self.gguf_int8_prefill and not self.gguf_bf16_copies:
            raise ConfigError("gguf_int8_prefill: int8 copies sit beside a GGUF file's blocks "
                              "and their bfloat16 copies (gguf_bf16_copies)")
        if self.runner not in RUNNER_TYPES:
            raise ConfigError(f"runner={self.runner!r}: expected one of "
                              f"{', '.join(RUNNER_TYPES)}")
        if self.runner == "pooling" and self.pooler_config is None:
            object.__setattr__(self, "pooler_config", PoolerConfig())
        elif self.runner == "generate" and self.pooler_config is not None:
            raise ConfigError("pooler_config applies to a pooling model: pass runner='pooling' "
                              "(or convert='embed') with it")

    hidden_size = property(lambda self: self.hf_config.hidden_size)
    @property
    def tokenizer_path(self) -> str:
        return self.model if self.tokenizer is None else self.tokenizer

    @property
    def architecture(self) -> str:
        return self.hf_config.architectures[0]

    num_layers = property(lambda self: self.hf_config.num_hidden_layers)
    num_attention_heads = property(lambda self: self.hf_config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        head_dim = getattr(self.hf_config, "head_dim", None)
        return head_dim or self.hf_config.hidden_size // self.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def kv_cache_layout(self) -> KVCacheLayout:
        """The layers' KV cache groups and tensors (the scheduler's and the worker's); a
        config without layers (a scheduler's, in tests) has one group of one layer."""
        return KVCacheLayout.for_model(self.hf_config)


# vLLM's kv_cache_dtype values that mrv2 stores, and their element type; "auto" stores the
# model's dtype (a 16-bit model's on the CPU too, where it computes in float32: as vLLM's
# "auto" would, half the bytes a decode step reads). fp8 and int8 caches are not implemented.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "bfloat16": torch.bfloat16,
                                                  "float16": torch.float16}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Memory for the KV cache, all layers, K and V. None: the platform's default.
    kv_cache_memory_gb: float | None = None
    enable_prefix_caching: bool = True
    # vLLM's: the share of a GPU's memory the engine may use; the KV cache gets the rest of
    # it after weights and the profiled step peak (not used on the CPU).
    gpu_memory_utilization: float = 0.9
    # vLLM's kv_cache_dtype: what the cache stores (attention computes in the model's dtype).
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype={self.cache_dtype!r} is not supported: mrv2 "
                              f"stores {', '.join(map(repr, KV_CACHE_DTYPES))} ('auto': the "
                              f"model's dtype); fp8 and int8 caches are not implemented")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be "
                              f"in (0, 1]")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size={self.block_size} must be a power of two")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ConfigError(f"kv_cache_memory_gb={self.kv_cache_memory_gb} must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # Schedule step N+1 while step N runs; tokens not sampled yet are placeholders.
    async_scheduling: bool = True
    # vLLM's multi-step scheduling: a step whose rows all decode by argmax runs up to this many
    # decode steps in the runner before the scheduler sees them (core/decode_steps.py). None
    # (auto): AUTO_DECODE_STEPS while no running request streams its tokens, else 1.
    num_scheduler_steps: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "num_scheduler_steps", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}={value} must be at least 1")


@dataclass(frozen=True)
class CompilationConfig:
    """Which batches run as captured CUDA graphs (mrv2/cudagraph).

    - "NONE": everything eager.
    - "FULL_DECODE_ONLY": one full graph per capture size for uniform-decode batches (every row
      has one query token); anything else runs eagerly.
    - "FULL": those decode graphs plus one full graph per capture size for any (mixed) batch.

    `cudagraph_capture_sizes=None` picks `default_capture_sizes()` up to
    `max_cudagraph_capture_size`; explicit sizes may not exceed it. `resolve()` fits the config
    to a device and to the scheduler limits; the graph manager only ever sees a resolved one.
    """

    # Not annotated, so a class constant rather than a dataclass field.
    MODES = ("NONE", "FULL_DECODE_ONLY", "FULL")

    # vLLM's default on CUDA: decode steps replay graphs, mixed batches run eagerly. `resolve`
    # turns it into "NONE" off CUDA and under enforce_eager.
    cudagraph_mode: Literal["NONE", "FULL_DECODE_ONLY", "FULL"] = "FULL_DECODE_ONLY"
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int = 512

    def __post_init__(self) -> None:
        if self.cudagraph_mode not in self.MODES:
            raise ConfigError(f"cudagraph_mode={self.cudagraph_mode!r}: expected one of "
                              f"{', '.join(self.MODES)}")
        if (isinstance(self.max_cudagraph_capture_size, bool)
                or not isinstance(self.max_cudagraph_capture_size, int)
                or self.max_cudagraph_capture_size < 1):
            raise ConfigError(f"max_cudagraph_capture_size={self.max_cudagraph_capture_size!r} "
                              f"must be a positive integer")
        sizes = self.cudagraph_capture_sizes
        if sizes is None:
            return
        if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
            raise ConfigError(f"cudagraph_capture_sizes={sizes!r} must be a sequence of ints")
        sizes = tuple(sizes)
        for size in sizes:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ConfigError(f"cudagraph_capture_sizes: {size!r} is not a positive integer")
        if sizes and max(sizes) > self.max_cudagraph_capture_size:
            raise ConfigError(f"cudagraph_capture_sizes has {max(sizes)}, more than "
                              f"max_cudagraph_capture_size={self.max_cudagraph_capture_size}")
        # Stored sorted and without duplicates, as a tuple, so equal configs compare equal.
        object.__setattr__(self, "cudagraph_capture_sizes", tuple(sorted(set(sizes))))

    @property
    def capture_sizes(self) -> tuple[int, ...]:
        """Sorted batch sizes (in tokens) to capture, before fitting to any limit."""
        if self.cudagraph_capture_sizes is not None:
            return self.cudagraph_capture_sizes
        return self.default_capture_sizes(self.max_cudagraph_capture_size)

    def resolve(self, device: str | torch.device, max_num_batched_tokens: int,
                max_num_seqs: int, enforce_eager: bool = False) -> CompilationConfig:
        """The config that actually runs on `device` under these limits (idempotent).

        Not CUDA, or `enforce_eager`: mode "NONE". Sizes are clipped to max_num_batched_tokens,
        and for "FULL_DECODE_ONLY" also to max_num_seqs (a decode batch has one token per row).
        No size left: mode "NONE". A resolved "NONE" config has no sizes.
        """
        mode = self.cudagraph_mode
        if enforce_eager or torch.device(device).type != "cuda":
            mode = "NONE"
        limit = max_num_batched_tokens
        if mode == "FULL_DECODE_ONLY":
            limit = min(limit, max_num_seqs)
        sizes = tuple(s for s in self.capture_sizes if s <= limit) if mode != "NONE" else ()
        if not sizes:
            mode = "NONE"
        return CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=sizes,
                                 max_cudagraph_capture_size=self.max_cudagraph_capture_size)

    @staticmethod
    def default_capture_sizes(max_size: int) -> tuple[int, ...]:
        """[1, 2, 4], multiples of 8 up to 256, then multiples of 16, all up to `max_size`."""
        sizes = [1, 2, 4, *range(8, 257, 8), *range(272, max_size + 1, 16)]
        return tuple(s for s in sizes if s <= max_size)


# vLLM's reasoning parsers whose reasoning ends with a `</think>` token.
REASONING_PARSER_NAMES = ("qwen3", "deepseek_r1")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's `structured_outputs_config`: engine-wide settings of grammar-constrained
    decoding (per-request constraints are SamplingParams.structured_outputs)."""

    # "auto" and "xgrammar" both mean xgrammar, the one backend mrv2 implements.
    backend: str = "xgrammar"
    # Engine-wide defaults, OR-ed with the request's flags of the same names.
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    # A model that thinks first (`<think> ... </think>`): the constraint applies from the
    # end of its reasoning on, unless enable_in_reasoning. None: no reasoning.
    reasoning_parser: str | None = None
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "xgrammar"):
            raise ConfigError(f"structured_outputs_config.backend={self.backend!r}: mrv2 "
                              f"implements 'xgrammar' (and 'auto', which picks it)")
        if self.reasoning_parser not in (None, "", *REASONING_PARSER_NAMES):
            raise ConfigError(f"reasoning_parser={self.reasoning_parser!r}: expected one of "
                              f"{', '.join(REASONING_PARSER_NAMES)}")


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = ParallelConfig()
    # EngineArgs passes the config resolved for the device; one built by hand runs eagerly.
    compilation_config: CompilationConfig = CompilationConfig(cudagraph_mode="NONE")
    device: str = "cpu"
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding

    def __post_init__(self) -> None:
        self.parallel_config.verify_model(self.model_config)
        self.parallel_config.verify_pipeline(self)
        # max_model_len lives in model_config only; the scheduler's budget is checked here.
        sched, max_model_len = self.scheduler_config, self.model_config.max_model_len
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens={sched.max_num_batched_tokens} is smaller than "
                f"max_model_len={max_model_len} and chunked prefill is disabled")
        if self.speculative_config is not None and sched.num_scheduler_steps not in (None, 1):
            raise ConfigError("speculative decoding verifies one step at a time: "
                              "num_scheduler_steps must be 1 or None (auto)")
        if self.model_config.kv_cache_layout.recurrent:
            self._verify_recurrent_layers()
        pooler = self.model_config.pooler_config
        if (pooler is not None and pooler.pooling_type == "MEAN"
                and self.cache_config.enable_prefix_caching):
            raise ConfigError("pooling_type='MEAN' averages the hidden states of every prompt "
                              "token, and a prefix-cache hit skips computing the cached ones: "
                              "turn prefix caching off (it is off by default with MEAN)")

    def _verify_recurrent_layers(self) -> None:
        """Refuse, by name, what a hybrid model's recurrent layers (Qwen3-Next, Qwen3.5) do
        not run: a state exists only after the last computed token of a request."""
        name = self.model_config.architecture
        if self.cache_config.enable_prefix_caching:
            raise ConfigError(f"enable_prefix_caching=True: {name} has recurrent layers, whose "
                              f"state a cached prefix does not hold (it is off by default)")
        if self.speculative_config is not None:
            raise ConfigError(f"speculative decoding is not supported for {name}: rejected "
                              f"drafts would have to be rolled out of its recurrent state")
        if self.model_config.batch_invariant:
            raise ConfigError(f"batch_invariant=True is not supported for {name} (its "
                              f"recurrent layers' kernels are not verified batch-invariant)")

    @property
    def max_steps_in_flight(self) -> int:
        """Steps the engine core submits before it folds the oldest one's output: with async
        scheduling 2 (step N+1 scheduled while N runs), or one per pipeline stage (micro-batches
        of disjoint requests, every stage busy: mrv2/pipeline.py); else 1."""
        if not self.scheduler_config.async_scheduling:
            return 1
        return max(2, self.parallel_config.pipeline_parallel_size)

    @property
    def max_kv_tokens_per_step(self) -> int:
        """The most tokens whose KV one step writes for a request (a chunk, or decode steps).
        Auto runs are not counted: they run only while the pool has their blocks."""
        sched = self.scheduler_config
        return sched.max_num_batched_tokens + (sched.num_scheduler_steps or 1) - 1

    @property
    def max_num_blocks_per_req(self) -> int:
        return -(-self.model_config.max_model_len // self.cache_config.block_size)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's element type: kv_cache_dtype's, or the model's for "auto"."""
        model = self.model_config
        # a quantized model's cpu_weight_dtype is its prefill tiles' (not the cache's); with
        # bfloat16 copies it is a bfloat16 model's from a few rows on, bfloat16 cache included
        blocks_alone = model.quantization and not model.gguf_bf16_copies
        return (KV_CACHE_DTYPES[self.cache_config.cache_dtype]
                or (None if blocks_alone else model.cpu_weight_dtype) or model.dtype)
