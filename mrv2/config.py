"""Frozen engine configuration. One `EngineConfig` is passed whole to every component.

Values are validated when built by `EngineArgs.create_engine_config()`; derived values are
properties so that they can never disagree with the fields they come from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch


class ConfigError(ValueError):
    """An engine argument is invalid. Raised before any model work starts."""


@dataclass(frozen=True)
class ModelConfig:
    model: str
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    # transformers PretrainedConfig, read through AutoConfig. Not compared or printed.
    hf_config: Any = field(default=None, compare=False, repr=False)

    @property
    def architecture(self) -> str:
        return self.hf_config.architectures[0]

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_attention_heads(self) -> int:
        return self.hf_config.num_attention_heads

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


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Memory for the KV cache, all layers, K and V. None: the platform's default.
    kv_cache_memory_gb: float | None = None
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size={self.block_size} must be a power of two")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ConfigError(f"kv_cache_memory_gb={self.kv_cache_memory_gb} must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs={self.max_num_seqs} must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be at least 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len} and chunked prefill is disabled")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size != 1:
            raise ConfigError(
                f"tensor_parallel_size={self.tensor_parallel_size}: only 1 is supported so far")


@dataclass(frozen=True)
class CompilationConfig:
    cudagraph_mode: Literal["NONE", "FULL_DECODE_ONLY", "FULL"] = "NONE"


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = ParallelConfig()
    compilation_config: CompilationConfig = CompilationConfig()
    device: str = "cpu"

    @property
    def max_num_blocks_per_req(self) -> int:
        return -(-self.model_config.max_model_len // self.cache_config.block_size)
