"""Model directory, config, weights and dtype handling: clear errors before any model work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from mrv2.config import ModelConfig
from mrv2.models import (SUPPORTED_ARCHITECTURES, LlamaForCausalLM, ModelNotFoundError,
                         Qwen3ForCausalLM, UnsupportedModelError, get_model_class,
                         iterate_safetensors, load_hf_config, load_model, resolve_dtype)
from mrv2.models.loader import CPU_AUTO_DTYPE_ENV, cpu_auto_dtype


@pytest.fixture
def model_dir(tiny_llama: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny llama that a test may break."""
    return Path(shutil.copytree(tiny_llama, tmp_path / "model"))


def _model_config(path: Path, dtype: torch.dtype = torch.float32) -> ModelConfig:
    return ModelConfig(model=str(path), dtype=dtype, max_model_len=32,
                       hf_config=load_hf_config(str(path)))


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_hf_config(str(tmp_path / "nope"))


def test_path_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ModelNotFoundError, match="is not a directory"):
        load_hf_config(str(tmp_path / "f"))


def test_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError,
                       match="is not a Hugging Face model directory: no config.json"):
        load_hf_config(str(tmp_path))


def test_unsupported_architecture_is_refused_before_weights(model_dir: Path) -> None:
    _edit_config(model_dir, architectures=["GPT2LMHeadModel"])
    (model_dir / "model.safetensors").unlink()  # never reached
    with pytest.raises(UnsupportedModelError) as info:
        load_hf_config(str(model_dir))
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)
    # Also when transformers does not know the model_type at all.
    _edit_config(model_dir, model_type="not_a_real_model_type")
    with pytest.raises(UnsupportedModelError):
        load_hf_config(str(model_dir))


def test_registry() -> None:
    assert SUPPORTED_ARCHITECTURES == (
        "LlamaForCausalLM", "MistralForCausalLM", "Ministral3ForCausalLM", "Qwen2ForCausalLM",
        "Qwen3ForCausalLM", "Phi3ForCausalLM", "SmolLM3ForCausalLM", "Olmo2ForCausalLM",
        "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma4ForCausalLM", "Qwen3MoeForCausalLM",
        "Qwen2MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM", "GptOssForCausalLM",
        "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
    assert get_model_class(["LlamaForCausalLM"]) is LlamaForCausalLM
    assert get_model_class(["Qwen3ForCausalLM"]) is Qwen3ForCausalLM
    assert issubclass(UnsupportedModelError, ValueError)
    for bad in ([], None, ["DeepseekV3ForCausalLM"]):
        with pytest.raises(UnsupportedModelError, match="supported architectures: "
                                                        "LlamaForCausalLM, MistralForCausalLM"):
            get_model_class(bad)


def test_quantization_the_model_does_not_load_is_refused_by_name(model_dir: Path) -> None:
    """A checkpoint's quantization_config: refused before any weight is read unless its
    model class loads the method (gpt-oss: mxfp4, tests/models/test_gpt_oss.py)."""
    _edit_config(model_dir, quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ValueError, match="quant_method='mxfp4' is not supported for "
                                         "LlamaForCausalLM; supported: none"):
        load_hf_config(str(model_dir))


def test_missing_weights_file(model_dir: Path) -> None:
    mc = _model_config(model_dir)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError,
                       match="no model.safetensors or model.safetensors.index.json"):
        load_model(mc, torch.device("cpu"))


def test_sharded_index_with_missing_shard(tiny_model_factory, tmp_path: Path) -> None:
    path = Path(shutil.copytree(tiny_model_factory("llama", num_shards=2), tmp_path / "m"))
    sharded = dict(iterate_safetensors(str(path)))
    single = dict(iterate_safetensors(str(tiny_model_factory("llama"))))
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="lists shards that do not exist"):
        list(iterate_safetensors(str(path)))


@pytest.mark.parametrize("dropped,reported", [
    ("model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.qkv_proj.weight"),
    ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"),
    ("model.norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
])
def test_missing_tensor(model_dir: Path, dropped: str, reported: str) -> None:
    weights = load_file(model_dir / "model.safetensors")
    del weights[dropped]
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"missing weights for 1 parameter.*{reported}"):
        load_model(_model_config(model_dir), torch.device("cpu"))


def test_wrong_shape_tensor(model_dir: Path) -> None:
    weights = load_file(model_dir / "model.safetensors")
    weights["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"o_proj.weight: .*shape \(3, 3\)"):
        load_model(_model_config(model_dir), torch.device("cpu"))


def test_load_model_converts_dtype_and_returns_eval(tiny_llama: Path) -> None:
    model = load_model(_model_config(tiny_llama, torch.bfloat16), torch.device("cpu"))
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # Rotary tables stay float32 (cast per step); the default dtype is restored.
    assert model.model.rotary_emb.cos_cache.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32
    reference = load_file(tiny_llama / "model.safetensors")["model.norm.weight"]
    assert torch.equal(model.model.norm.weight, reference.to(torch.bfloat16))


def test_resolve_dtype() -> None:
    bf16_config = SimpleNamespace(dtype=torch.bfloat16)
    assert resolve_dtype("auto", bf16_config, "cpu") == cpu_auto_dtype()
    assert resolve_dtype("auto", bf16_config, "cuda") == torch.bfloat16
    # transformers 4.x spelling, stored as a string.
    assert resolve_dtype("auto", SimpleNamespace(torch_dtype="float16"), "cuda") == torch.float16
    assert resolve_dtype("auto", SimpleNamespace(), "cuda") == torch.float32
    for name, dtype in (("float32", torch.float32), ("float", torch.float32),
                        ("bfloat16", torch.bfloat16), ("float16", torch.float16),
                        ("half", torch.float16)):
        assert resolve_dtype(name, bf16_config, "cpu") == dtype
    assert resolve_dtype(torch.float16, None, "cpu") == torch.float16
    for bad in ("int8", "fp8", torch.int8):
        with pytest.raises(ValueError, match="accepted: 'auto', 'float32', 'float', "
                                             "'bfloat16', 'float16', 'half'"):
            resolve_dtype(bad, bf16_config, "cpu")


@pytest.mark.parametrize("native", [False, True])
def test_cpu_auto_dtype_follows_the_cpu_and_the_override(native, monkeypatch) -> None:
    from mrv2.models.layers import cpu_linear

    monkeypatch.delenv(CPU_AUTO_DTYPE_ENV, raising=False)
    monkeypatch.setattr(cpu_linear, "computes_natively", lambda d: native and d == torch.bfloat16)
    assert cpu_auto_dtype() == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("auto", SimpleNamespace(dtype=torch.float16), "cpu") == cpu_auto_dtype()
    for value, dtype in (("float32", torch.float32), (" BFloat16 ", torch.bfloat16),
                         ("float16", torch.float16)):
        monkeypatch.setenv(CPU_AUTO_DTYPE_ENV, value)
        assert cpu_auto_dtype() == dtype
    monkeypatch.setenv(CPU_AUTO_DTYPE_ENV, "fp8")
    with pytest.raises(ValueError, match="MRV2_CPU_AUTO_DTYPE='fp8'"):
        resolve_dtype("auto", None, "cpu")


@pytest.mark.parametrize("native", [False, True])
def test_split_cpu_dtype(monkeypatch, native) -> None:
    # On the CPU 16-bit weights and float32 activations, whatever matrix units it has (the
    # linears use them: cpu_linear.native_16bit_linear); on CUDA one dtype.
    from mrv2 import platform
    from mrv2.models.loader import split_cpu_dtype

    monkeypatch.setattr(platform, "cpu_computes_natively", lambda d: native or d == torch.float32)
    assert split_cpu_dtype(torch.bfloat16, "cpu") == (torch.float32, torch.bfloat16)
    assert split_cpu_dtype(torch.float16, "cpu") == (torch.float32, torch.float16)
    assert split_cpu_dtype(torch.float32, "cpu") == (torch.float32, None)
    assert split_cpu_dtype(torch.bfloat16, "cuda") == (torch.bfloat16, None)


# Run in a fresh process: loads a GGUF with quantization="gguf" (load_model, then the worker's
# cpu.prepare) and prints the peak RSS growth of loading argv[2], in bytes. argv[1], loaded
# first, imports and compiles whatever the load and prepare run, so that only memory that
# scales with the model counts.
_PEAK_RSS_SCRIPT = r"""
import sys
import torch
from mrv2.engine.arg_utils import EngineArgs
from mrv2.models import cpu
from mrv2.models.loader import load_model


def load(path):
    config = EngineArgs(model=path, max_model_len=64, quantization="gguf",
                        device="cpu").create_engine_config().model_config
    model = load_model(config, torch.device("cpu"))
    return model, cpu.prepare(model, config)


def kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


warm = load(sys.argv[1])
del warm
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from the current RSS
start = kib("VmRSS")
loaded = load(sys.argv[2])
print((kib("VmHWM") - start) * 1024)
"""


def test_peak_rss_loading_a_quantized_gguf_follows_the_file(tiny_gguf_factory) -> None:
    """Issue 48: loading SmolLM2's 98 MB Q4_1 file with quantization="gguf" grew the process
    by ~620 MB (every tensor dequantized to float32, then repacked). The blocks go straight to
    their packed form, the file's pages are dropped once copied: under 2x the file's size."""
    import os
    import subprocess
    import sys

    from mrv2.models.builtin import builtin_model_path

    try:
        path = builtin_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    warm = tiny_gguf_factory("llama", "Q4_1", tensor_types={"token_embd.weight": "Q8_0"},
                             tie_word_embeddings=True)
    run = subprocess.run([sys.executable, "-c", _PEAK_RSS_SCRIPT, str(warm), str(path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    growth, size = int(run.stdout.split()[-1]), path.stat().st_size
    assert growth < 2 * size, f"peak RSS grew by {growth / 1e6:.0f} MB, file {size / 1e6:.0f} MB"
