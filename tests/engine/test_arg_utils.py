"""EngineArgs.create_engine_config: defaults, derived values, and validation order."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from mrv2 import platform
from mrv2.config import ConfigError
from mrv2.engine.arg_utils import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineArgs
from mrv2.models.loader import ModelNotFoundError


@pytest.fixture
def config_only_dir(tiny_llama, tmp_path):
    """A copy of tiny_llama's config.json with a chosen max_position_embeddings (no weights:
    create_engine_config reads the config only)."""

    def make(max_position_embeddings: int):
        raw = json.loads((tiny_llama / "config.json").read_text())
        raw["max_position_embeddings"] = max_position_embeddings
        d = tmp_path / f"cfg-{max_position_embeddings}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(raw))
        return str(d)

    return make


def test_defaults(tiny_llama):
    config = EngineArgs(model=str(tiny_llama)).create_engine_config()
    assert config.device == platform.device_type()
    assert config.model_config.model == str(tiny_llama)
    assert config.model_config.max_model_len == 2048  # the model's max_position_embeddings
    assert config.model_config.seed == 0
    assert config.cache_config.block_size == 16
    assert config.cache_config.kv_cache_memory_gb is None
    assert config.cache_config.enable_prefix_caching  # vLLM default: on
    assert config.scheduler_config.max_num_seqs == 256
    assert config.scheduler_config.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert config.model_config.max_model_len == 2048
    assert config.parallel_config.tensor_parallel_size == 1
    assert config.compilation_config.cudagraph_mode == "NONE"
    assert config.model_config.hf_config.architectures == ["LlamaForCausalLM"]
    assert config.model_config.logprobs_mode == "raw_logprobs"  # vLLM default


@pytest.mark.parametrize("given, parallel, expected", [
    (None, {}, False),  # one CPU process: nothing to overlap
    (None, {"tensor_parallel_size": 2}, True),  # worker processes run while the core schedules
    (None, {"pipeline_parallel_size": 2}, True),  # a micro-batch per stage in flight
    (True, {}, True), (False, {"tensor_parallel_size": 2}, False)])  # as given
def test_async_scheduling_default_on_the_cpu(tiny_llama, given, parallel, expected):
    config = EngineArgs(model=str(tiny_llama), device="cpu", async_scheduling=given,
                        **parallel).create_engine_config()
    assert config.scheduler_config.async_scheduling is expected
    assert config.max_steps_in_flight == (2 if expected else 1)


def test_values_passed_through(tiny_llama):
    config = EngineArgs(model=str(tiny_llama), max_model_len=100, max_num_seqs=8,
                        max_num_batched_tokens=64, block_size=32, seed=7, kv_cache_memory_gb=0.5,
                        enable_prefix_caching=True, device="cpu").create_engine_config()
    assert config.model_config.max_model_len == 100
    assert config.scheduler_config.max_num_seqs == 8
    assert config.scheduler_config.max_num_batched_tokens == 64
    assert config.cache_config.block_size == 32
    assert config.cache_config.kv_cache_memory_gb == 0.5
    assert config.cache_config.enable_prefix_caching
    assert config.model_config.seed == 7
    assert config.max_num_blocks_per_req == 4  # ceil(100 / 32)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "raw_logits",
                                  "processed_logits"])
def test_logprobs_mode_reaches_the_sampler(tiny_llama, mode):
    from mrv2.worker import Worker

    config = EngineArgs(model=str(tiny_llama), max_model_len=64, max_num_seqs=2,
                        logprobs_mode=mode, device="cpu").create_engine_config()
    assert config.model_config.logprobs_mode == mode
    worker = Worker(config)
    worker.load_model()
    worker.initialize_kv_cache(8)
    assert worker.runner.sampler.logprobs_mode == mode


def test_batched_tokens_default_covers_max_num_seqs(tiny_llama):
    config = EngineArgs(model=str(tiny_llama), max_model_len=64, max_num_seqs=5000,
                        device="cpu").create_engine_config()
    assert config.scheduler_config.max_num_batched_tokens == 5000


def test_max_model_len_from_max_position_embeddings(config_only_dir):
    path = config_only_dir(256)
    assert EngineArgs(model=path, device="cpu").create_engine_config() \
        .model_config.max_model_len == 256
    assert EngineArgs(model=path, max_model_len=256, device="cpu").create_engine_config() \
        .model_config.max_model_len == 256


def test_too_large_max_model_len_names_both_numbers(config_only_dir):
    with pytest.raises(ConfigError) as info:
        EngineArgs(model=config_only_dir(256), max_model_len=257,
                   device="cpu").create_engine_config()
    assert "257" in str(info.value) and "256" in str(info.value)


def test_negative_max_model_len(tiny_llama):
    with pytest.raises(ConfigError, match="max_model_len=-1"):
        EngineArgs(model=str(tiny_llama), max_model_len=-1, device="cpu").create_engine_config()


def test_zero_max_model_len_rejected(tiny_llama):
    with pytest.raises(ConfigError, match="max_model_len=0"):
        EngineArgs(model=str(tiny_llama), max_model_len=0, device="cpu").create_engine_config()


def test_zero_max_num_batched_tokens_rejected(tiny_llama):
    with pytest.raises(ConfigError, match="max_num_batched_tokens=0"):
        EngineArgs(model=str(tiny_llama), max_num_batched_tokens=0,
                   device="cpu").create_engine_config()


@pytest.mark.parametrize("device", ["tpu", "gpu", "CPU", " "])
def test_bad_device(tiny_llama, device):
    with pytest.raises(ConfigError, match="device="):
        EngineArgs(model=str(tiny_llama), device=device).create_engine_config()


def test_bad_device_checked_before_model_dir(tmp_path):
    with pytest.raises(ConfigError, match="device='tpu'"):
        EngineArgs(model=str(tmp_path / "missing"), device="tpu").create_engine_config()


def test_dtype_auto_is_float32_on_cpu(tiny_llama, tmp_path):
    assert EngineArgs(model=str(tiny_llama), device="cpu").create_engine_config() \
        .model_config.dtype == torch.float32
    # Even for a bf16 checkpoint (DESIGN.md section 5: bf16 matmul is very slow on CPU).
    d = tmp_path / "bf16"
    d.mkdir()
    raw = json.loads((tiny_llama / "config.json").read_text())
    raw["dtype"] = raw["torch_dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(raw))
    assert EngineArgs(model=str(d), device="cpu").create_engine_config() \
        .model_config.dtype == torch.float32


@pytest.mark.parametrize("dtype, expected", [("float32", torch.float32),
                                             ("bfloat16", torch.bfloat16),
                                             ("half", torch.float16)])
@pytest.mark.parametrize("native", [True, False])
def test_explicit_dtype(tiny_llama, dtype, expected, native, monkeypatch):
    # On the CPU a 16-bit dtype's weights stay 16-bit and the activations run in float32,
    # with or without matrix instructions for it.
    from mrv2 import platform

    monkeypatch.setattr(platform, "cpu_computes_natively",
                        lambda d: native or d == torch.float32)
    config = EngineArgs(model=str(tiny_llama), dtype=dtype, device="cpu").create_engine_config()
    if expected == torch.float32:
        assert (config.model_config.dtype, config.model_config.cpu_weight_dtype) == (
            expected, None)
    else:
        assert (config.model_config.dtype, config.model_config.cpu_weight_dtype) == (
            torch.float32, expected)


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_is_decided_by_the_cpu(tiny_llama, native, monkeypatch):
    # dtype="auto" on the CPU: bfloat16 weights (and KV cache) where the CPU computes bf16 on
    # matrix units, float32 where it would emulate it; a GGUF file's blocks keep their types.
    from mrv2.models.layers import cpu_linear
    from mrv2.models.loader import CPU_AUTO_DTYPE_ENV

    monkeypatch.delenv(CPU_AUTO_DTYPE_ENV, raising=False)  # tests/conftest.py pins float32
    monkeypatch.setattr(cpu_linear, "computes_natively", lambda d: native)
    config = EngineArgs(model=str(tiny_llama), device="cpu").create_engine_config()
    weights = torch.bfloat16 if native else None
    assert (config.model_config.dtype, config.model_config.cpu_weight_dtype) == (
        torch.float32, weights)
    assert config.kv_cache_dtype == (torch.bfloat16 if native else torch.float32)
    monkeypatch.setenv(CPU_AUTO_DTYPE_ENV, "float32")
    config = EngineArgs(model=str(tiny_llama), device="cpu").create_engine_config()
    assert config.model_config.cpu_weight_dtype is None


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_runs_a_gguf_on_its_blocks_and_bfloat16_copies_where_the_cpu_picks_it(
        tiny_gguf_factory, native, monkeypatch):
    """dtype="auto" on the CPU: a GGUF of quantized linears runs on its blocks; where the
    machine picks bfloat16 each also holds a bfloat16 copy for many rows (loader.cpu_auto_gguf)
    and, where oneDNN multiplies int8 on VNNI, integer blocks an int8 copy for a prompt's rows
    (not F16; not with MRV2_GGUF_PREFILL=bf16), unless the copies and the file would take more
    than half the available memory (the int8 copies dropped first, then the bfloat16 ones:
    blocks alone) or batch invariance is asked for (dequantized). F16 as quantized blocks; a
    BF16 file runs on its blocks where the machine picks float32 and is a bfloat16 model where
    it picks bfloat16; a dtype by name, MRV2_CPU_AUTO_DTYPE or a float32 file dequantize at
    load; quantization="gguf" by name: the blocks alone."""
    from mrv2 import cpu_caps
    from mrv2.models import loader
    from mrv2.models.gguf import bf16_copy_elements, open_gguf
    from mrv2.models.layers import cpu_linear, int8_linear
    from mrv2.models.loader import CPU_AUTO_DTYPE_ENV

    monkeypatch.delenv(CPU_AUTO_DTYPE_ENV, raising=False)  # tests/conftest.py pins float32
    monkeypatch.setattr(cpu_linear, "computes_natively", lambda d: native)
    monkeypatch.setattr(int8_linear, "int8_products_run", lambda: True)

    def quantization(tensor_type: str = "Q8_0", **kwargs) -> tuple[str | None, bool, bool]:
        args = EngineArgs(model=str(tiny_gguf_factory("llama", tensor_type)), device="cpu",
                          **kwargs)
        config = args.create_engine_config().model_config
        return config.quantization, config.gguf_bf16_copies, config.gguf_int8_prefill

    assert quantization() == ("gguf", native, native)
    assert quantization("Q4_0", batch_invariant=True) == ((None, False, False) if native
                                                          else ("gguf", False, False))
    assert quantization("F16") == ("gguf", native, False)
    assert quantization("BF16") == ((None, False, False) if native else ("gguf", False, False))
    assert quantization("F32") == (None, False, False)
    assert quantization(dtype="float32") == (None, False, False)
    assert quantization(dtype="bfloat16") == (None, False, False)
    assert quantization(quantization="gguf") == ("gguf", False, False)
    machine = cpu_caps.caps
    monkeypatch.setattr(cpu_caps, "caps", lambda: cpu_caps.CpuCaps(gguf_prefill="bf16"))
    assert quantization() == ("gguf", native, False)
    monkeypatch.setattr(cpu_caps, "caps", machine)
    path = tiny_gguf_factory("llama", "Q8_0")
    ckpt = open_gguf(str(path))
    file_bytes = sum(os.path.getsize(f) for f in ckpt.files)
    copies = 2 * bf16_copy_elements(ckpt)
    int8 = bf16_copy_elements(ckpt, integer_blocks_only=True)
    assert 0 < int8 <= copies // 2
    monkeypatch.setattr(loader, "available_memory_bytes",
                        lambda: 2 * (file_bytes + copies + int8 - 1))
    assert quantization() == ("gguf", native, False)  # room for the bfloat16 copies alone
    monkeypatch.setattr(loader, "available_memory_bytes", lambda: 1 << 16)
    assert quantization() == ("gguf", False, False)
    monkeypatch.setenv(CPU_AUTO_DTYPE_ENV, "float32")
    assert quantization() == (None, False, False)


def test_bfloat16_copies_serve_gguf_blocks_in_a_bfloat16_model_only():
    from mrv2.config import ModelConfig

    for fields in ({"quantization": None, "cpu_weight_dtype": torch.bfloat16},
                   {"quantization": "gguf", "cpu_weight_dtype": None}):
        with pytest.raises(ConfigError, match="gguf_bf16_copies"):
            ModelConfig(model="m.gguf", dtype=torch.float32, max_model_len=8,
                        gguf_bf16_copies=True, **fields)
    with pytest.raises(ConfigError, match="gguf_int8_prefill"):  # int8 beside the copies only
        ModelConfig(model="m.gguf", dtype=torch.float32, max_model_len=8, quantization="gguf",
                    cpu_weight_dtype=torch.bfloat16, gguf_int8_prefill=True)


def test_bad_dtype(tiny_llama):
    with pytest.raises(ValueError, match="int8"):
        EngineArgs(model=str(tiny_llama), dtype="int8", device="cpu").create_engine_config()


@pytest.mark.parametrize("kwargs, match", [
    ({"block_size": 3}, "block_size=3"),
    ({"block_size": 0}, "block_size=0"),
    ({"kv_cache_memory_gb": 0}, "kv_cache_memory_gb=0"),
    ({"kv_cache_memory_gb": -1.0}, "kv_cache_memory_gb=-1.0"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size=0"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
     "tensor_parallel_size=2"),
    ({"logprobs_mode": "raw"}, "logprobs_mode='raw'.*raw_logprobs, raw_logits, "
                               "processed_logprobs, processed_logits"),
])
def test_cheap_checks_before_model_dir_is_read(tmp_path, kwargs, match):
    # The path does not exist: these errors must come first.
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model=str(tmp_path / "missing"), device="cpu", **kwargs).create_engine_config()


def test_scheduler_limits_checked(tiny_llama):
    with pytest.raises(ConfigError, match="max_num_seqs=0"):
        EngineArgs(model=str(tiny_llama), max_num_seqs=0, device="cpu").create_engine_config()


def test_missing_model_dir(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        EngineArgs(model=str(tmp_path / "missing"), device="cpu").create_engine_config()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        EngineArgs(model=str(tmp_path / "empty"), device="cpu").create_engine_config()


def test_config_only_dir_is_enough_for_the_config(tiny_llama, tmp_path):
    d = tmp_path / "cfg"
    d.mkdir()
    shutil.copy(tiny_llama / "config.json", d / "config.json")
    config = EngineArgs(model=str(d), max_model_len=64, device="cpu").create_engine_config()
    assert config.model_config.vocab_size == 2048
    assert config.model_config.num_kv_heads == 2 and config.model_config.head_dim == 16


@pytest.mark.parametrize("value", [{"cudagraph_mode": "FULL_DECODE_ONLY"}, None])
def test_cudagraph_mode_resolves_to_none_on_cpu(tiny_llama, value):
    config = EngineArgs(model=str(tiny_llama), device="cpu",
                        compilation_config=value).create_engine_config()
    assert config.compilation_config.cudagraph_mode == "NONE"


@pytest.mark.parametrize("value, words", [
    ({"cudagraph_mode": "SOMETIMES"}, "SOMETIMES"),
    ({"no_such_field": 1}, "no_such_field"),
    ("FULL", "str"),
    (42, r"compilation_config=42 \(--compilation-config\).*0-3"),  # an int is a level
])
def test_bad_compilation_config(tiny_llama, value, words):
    with pytest.raises(ConfigError, match=words):
        EngineArgs(model=str(tiny_llama), compilation_config=value).create_engine_config()


@pytest.mark.parametrize("kwargs, mode", [
    ({"optimization_level": 0}, "NONE"),  # vLLM's -O0: no CUDA graphs
    ({"compilation_config": 0}, "NONE"),  # vLLM's older spelling of a level
    ({"optimization_level": 3}, "FULL_DECODE_ONLY"),  # 1-3: mrv2's default graphs
    ({"optimization_level": 0, "compilation_config": {"cudagraph_mode": "FULL"}}, "FULL"),
    ({"optimization_level": 0, "compilation_config": 2}, "FULL_DECODE_ONLY"),  # the config's
])
def test_optimization_level_sets_the_graph_mode_explicit_fields_win(kwargs, mode):
    # Before the device resolves it (on the CPU every mode resolves to "NONE").
    assert EngineArgs(model="/m", **kwargs)._compilation_config().cudagraph_mode == mode


# -- Hub ids, offline, from a Hub cache the test writes ----------------------------------------

@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "hub"
    cache.mkdir()
    return cache


def test_hub_ids_resolve_through_the_cache(offline_hub, tiny_model_factory, tiny_gguf_factory):
    from mrv2.testing.hub_cache import cache_model_dir, cache_repo

    snapshot = cache_model_dir(offline_hub, "org/tiny", tiny_model_factory("qwen2"))
    gguf = tiny_gguf_factory("qwen2", "Q8_0")
    cache_repo(offline_hub, "org/tiny-GGUF", {"tiny-Q8_0.gguf": gguf.read_bytes()})
    config = EngineArgs(model="org/tiny", download_dir=str(offline_hub)).create_engine_config()
    assert config.model_config.model == str(snapshot)
    assert config.model_config.architecture == "Qwen2ForCausalLM"
    config = EngineArgs(model="org/tiny-GGUF/tiny-Q8_0.gguf", tokenizer="org/tiny",
                        download_dir=str(offline_hub)).create_engine_config()
    assert config.model_config.model.endswith("tiny-Q8_0.gguf")
    assert config.model_config.tokenizer_path == str(snapshot)


def test_uncached_hub_id_offline_is_refused_before_loading(offline_hub):
    from mrv2.models.loader import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="org/absent"):
        EngineArgs(model="org/absent", download_dir=str(offline_hub)).create_engine_config()
    with pytest.raises(ModelNotFoundError, match="org/absent"):
        EngineArgs(model="org/absent/model.gguf",
                   download_dir=str(offline_hub)).create_engine_config()


def test_vllm_memory_arguments(tiny_llama, caplog):
    """kv_cache_memory_bytes sizes the KV cache (vLLM's), gpu_memory_utilization is kept for
    CUDA and said not to apply on the CPU; bad values are errors naming them."""
    config = EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=3 << 30,
                        device="cpu").create_engine_config()
    assert config.cache_config.kv_cache_memory_gb == 3.0
    assert config.cache_config.gpu_memory_utilization == 0.9  # vLLM's default
    with caplog.at_level("WARNING"):
        config = EngineArgs(model=str(tiny_llama), gpu_memory_utilization=0.5,
                            device="cpu").create_engine_config()
    assert config.cache_config.gpu_memory_utilization == 0.5
    assert "does not apply on the cpu" in caplog.text
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineArgs(model=str(tiny_llama), gpu_memory_utilization=1.5).create_engine_config()
    with pytest.raises(ConfigError, match="not both"):
        EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 30,
                   kv_cache_memory_gb=1.0).create_engine_config()
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes"):
        EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=0).create_engine_config()


def test_runner_convert_and_pooler_config(tiny_llama):
    """vLLM's runner / convert / pooler_config; MEAN pooling needs every prompt token, so
    prefix caching is off by default with it and refused when asked for."""
    def config(**kwargs):
        return EngineArgs(model=str(tiny_llama), **kwargs).create_engine_config()

    assert config().model_config.runner == "generate"
    for kwargs in ({"runner": "pooling"}, {"convert": "embed"},
                   {"runner": "pooling", "convert": "embed"}):
        made = config(**kwargs)
        assert made.model_config.runner == "pooling", kwargs
        assert made.model_config.pooler_config.pooling_type == "LAST"
        assert made.cache_config.enable_prefix_caching  # LAST keeps it
    mean = config(runner="pooling", pooler_config={"pooling_type": "MEAN", "normalize": False})
    assert not mean.cache_config.enable_prefix_caching
    assert not mean.model_config.pooler_config.normalize
    with pytest.raises(ConfigError, match="MEAN.*prefix caching"):
        config(runner="pooling", pooler_config={"pooling_type": "MEAN"},
               enable_prefix_caching=True)
    for kwargs, message in (({"runner": "embed"}, "runner='embed'"),
                            ({"convert": "classify"}, "convert='classify'"),
                            ({"runner": "generate", "convert": "embed"}, "runner='generate'"),
                            ({"runner": "pooling", "convert": "none"}, "convert='none'"),
                            ({"runner": "pooling", "pooler_config": {"dimensions": 8}},
                             "dimensions"),
                            ({"pooler_config": {"pooling_type": "MEAN"}}, "runner='pooling'")):
        with pytest.raises(ConfigError, match=message):
            config(**kwargs)


def test_chunked_prefill_off_budgets_a_whole_prompt(config_only_dir):
    """vLLM's rule: without chunked prefill a prompt is scheduled whole, so the default step
    budget is at least max_model_len; a budget set below it is refused."""
    model = config_only_dir(8192)
    sched = EngineArgs(model=model, enable_chunked_prefill=False,
                       device="cpu").create_engine_config().scheduler_config
    assert not sched.enable_chunked_prefill and sched.max_num_batched_tokens == 8192
    on = EngineArgs(model=model, device="cpu").create_engine_config().scheduler_config
    assert on.enable_chunked_prefill and on.max_num_batched_tokens < 8192
    with pytest.raises(ConfigError, match="chunked prefill is disabled"):
        EngineArgs(model=model, max_num_batched_tokens=512, enable_chunked_prefill=False,
                   device="cpu").create_engine_config()
