"""Engine configuration: validation (ConfigError, a ValueError) and derived values."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from mrv2.config import (
    CacheConfig,
    CompilationConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_logprobs_mode_validated() -> None:
    assert ModelConfig("m", torch.float32, 8).logprobs_mode == "raw_logprobs"
    assert ModelConfig("m", torch.float32, 8,
                       logprobs_mode="processed_logprobs").logprobs_mode == "processed_logprobs"
    with pytest.raises(ConfigError, match="logprobs_mode='x'.*raw_logprobs.*processed_logprobs"):
        ModelConfig("m", torch.float32, 8, logprobs_mode="x")


@pytest.mark.parametrize("block_size", [0, -4, 3, 6, 12, 24, 100])
def test_block_size_must_be_a_power_of_two(block_size: int) -> None:
    with pytest.raises(ConfigError, match="block_size"):
        CacheConfig(block_size=block_size)


@pytest.mark.parametrize("block_size", [1, 2, 8, 16, 32, 256])
def test_power_of_two_block_sizes_accepted(block_size: int) -> None:
    assert CacheConfig(block_size=block_size).block_size == block_size


def test_kv_cache_memory_must_be_positive() -> None:
    with pytest.raises(ConfigError):
        CacheConfig(kv_cache_memory_gb=0)
    with pytest.raises(ValueError):
        CacheConfig(kv_cache_memory_gb=-1.0)
    assert CacheConfig(kv_cache_memory_gb=0.5).kv_cache_memory_gb == 0.5


def test_scheduler_config_limits() -> None:
    with pytest.raises(ConfigError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ConfigError, match="num_scheduler_steps"):
        SchedulerConfig(num_scheduler_steps=0)
    assert SchedulerConfig(max_num_seqs=1).max_num_seqs == 1


def test_without_chunked_prefill_a_whole_prompt_must_fit() -> None:
    def config(budget: int, chunked: bool) -> EngineConfig:
        return EngineConfig(
            model_config=ModelConfig(model="tiny", dtype=torch.float32, max_model_len=1024),
            cache_config=CacheConfig(),
            scheduler_config=SchedulerConfig(max_num_batched_tokens=budget,
                                             enable_chunked_prefill=chunked))

    with pytest.raises(ConfigError, match="chunked prefill"):
        config(512, chunked=False)
    config(1024, chunked=False)
    config(512, chunked=True)


def make_engine_config(max_model_len: int, block_size: int) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig(model="tiny", dtype=torch.float32, max_model_len=max_model_len),
        cache_config=CacheConfig(block_size=block_size),
        scheduler_config=SchedulerConfig(),
    )


def test_kv_cache_dtype_values() -> None:
    """vLLM's kv_cache_dtype: "auto" follows the model, 16-bit types are stored as asked, fp8
    and int8 (vLLM's other values) are refused by name."""
    config = make_engine_config(64, 16)
    assert config.kv_cache_dtype == config.model_config.dtype
    # a bfloat16 model on the CPU (float32 compute, bfloat16 weights) stores bfloat16
    bf16_weights = dataclasses.replace(config.model_config, cpu_weight_dtype=torch.bfloat16)
    assert dataclasses.replace(config, model_config=bf16_weights).kv_cache_dtype == \
        torch.bfloat16
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        cache = CacheConfig(cache_dtype=name)
        assert dataclasses.replace(config, cache_config=cache).kv_cache_dtype == dtype
    for name in ("fp8", "fp8_e4m3", "int8", "float32", "half"):
        with pytest.raises(ConfigError, match=f"kv_cache_dtype='{name}'.*'bfloat16'"):
            CacheConfig(cache_dtype=name)


@pytest.mark.parametrize("max_model_len, block_size, expected", [
    (32, 16, 2), (33, 16, 3), (1, 16, 1), (2048, 16, 128), (100, 1, 100), (15, 8, 2),
])
def test_max_num_blocks_per_req(max_model_len: int, block_size: int, expected: int) -> None:
    assert make_engine_config(max_model_len, block_size).max_num_blocks_per_req == expected


def test_engine_config_defaults_and_frozen() -> None:
    config = make_engine_config(64, 16)
    assert config.parallel_config == ParallelConfig()
    assert config.compilation_config == CompilationConfig(cudagraph_mode="NONE")
    assert config.device == "cpu"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.device = "cuda"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache_config.block_size = 32  # type: ignore[misc]


def test_model_config_reads_hf_config() -> None:
    hf = SimpleNamespace(architectures=["LlamaForCausalLM"], num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
                         vocab_size=300)
    config = ModelConfig(model="tiny", dtype=torch.float32, max_model_len=128, hf_config=hf)
    assert config.architecture == "LlamaForCausalLM"
    assert config.num_layers == 2
    assert config.num_attention_heads == 8
    assert config.num_kv_heads == 2
    assert config.head_dim == 8  # hidden_size // heads when head_dim is absent
    assert config.vocab_size == 300
    hf.head_dim = 16
    hf.num_key_value_heads = None  # no GQA: as many KV heads as query heads
    assert config.head_dim == 16
    assert config.num_kv_heads == 8
    # hf_config is neither compared nor printed.
    assert config == ModelConfig(model="tiny", dtype=torch.float32, max_model_len=128)
    assert "hf_config" not in repr(config)


def test_pooler_config() -> None:
    from mrv2.config import PoolerConfig

    assert (PoolerConfig().pooling_type, PoolerConfig().normalize) == ("LAST", True)
    assert PoolerConfig("mean").pooling_type == "MEAN"
    with pytest.raises(ConfigError, match="pooling_type='CLS'.*LAST or MEAN"):
        PoolerConfig("CLS")
    with pytest.raises(ConfigError, match="normalize"):
        PoolerConfig(normalize="yes")  # type: ignore[arg-type]


def test_runner_and_its_pooler_config() -> None:
    from mrv2.config import PoolerConfig

    assert ModelConfig("m", torch.float32, 8).runner == "generate"
    pooling = ModelConfig("m", torch.float32, 8, runner="pooling")
    assert pooling.pooler_config == PoolerConfig()  # vLLM's default for a causal LM
    with pytest.raises(ConfigError, match="runner='embed'"):
        ModelConfig("m", torch.float32, 8, runner="embed")
    with pytest.raises(ConfigError, match="runner='pooling'"):
        ModelConfig("m", torch.float32, 8, pooler_config=PoolerConfig())

    def engine(pooling_type: str, caching: bool) -> EngineConfig:
        return EngineConfig(
            model_config=ModelConfig("m", torch.float32, 8, runner="pooling",
                                     pooler_config=PoolerConfig(pooling_type)),
            cache_config=CacheConfig(enable_prefix_caching=caching),
            scheduler_config=SchedulerConfig())

    engine("LAST", True)
    engine("MEAN", False)
    with pytest.raises(ConfigError, match="MEAN.*prefix caching"):
        engine("MEAN", True)
