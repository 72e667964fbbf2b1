"""mrv2.models.gguf.config: the metadata llama.cpp's converter wrote, mapped back to the
Hugging Face config the file came from."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig

from mrv2.models.gguf import GGUFError, gguf_hf_config, open_gguf
from mrv2.models.layers.rotary import compute_inv_freq, rope_parameters_from_config
from mrv2.models.registry import UnsupportedModelError

FIELDS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
          "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
          "bos_token_id", "eos_token_id", "architectures")
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize("arch,kwargs", [
    ("llama", {}), ("mistral", {}), ("qwen2", {"tie_word_embeddings": True}),
    ("qwen3", {"head_dim": 32}),  # head_dim != hidden / heads: read from key_length
])
def test_config_equals_the_source_config(tiny_model_factory, tiny_gguf_factory, arch, kwargs):
    source = AutoConfig.from_pretrained(tiny_model_factory(arch, **kwargs))
    config = gguf_hf_config(open_gguf(tiny_gguf_factory(arch, "F16", **kwargs)))
    for field in FIELDS:
        expected = getattr(source, field)
        if field == "architectures" and arch == "mistral":
            expected = ["LlamaForCausalLM"]  # the converter writes Mistral as "llama"
        assert getattr(config, field) == expected, field
    assert config.head_dim == (kwargs.get("head_dim") or source.hidden_size
                               // source.num_attention_heads)
    assert config.rms_norm_eps == pytest.approx(source.rms_norm_eps)
    assert (rope_parameters_from_config(config)["rope_theta"]
            == rope_parameters_from_config(source)["rope_theta"])
    assert bool(getattr(config, "attention_bias", False)) == bool(
        getattr(source, "attention_bias", False))
    assert config.dtype == torch.float16


def test_llama3_rope_factors_reproduce_the_scaled_frequencies(tiny_model_factory,
                                                              tiny_gguf_factory):
    source = AutoConfig.from_pretrained(tiny_model_factory("llama", rope_scaling=LLAMA3_ROPE))
    config = gguf_hf_config(open_gguf(tiny_gguf_factory("llama", "F32",
                                                        rope_scaling=LLAMA3_ROPE)))
    assert len(config.rope_freq_factors) == config.head_dim // 2
    assert max(config.rope_freq_factors) == 8.0
    head_dim = config.head_dim
    expected = compute_inv_freq(head_dim, rope_parameters_from_config(source))
    got = compute_inv_freq(head_dim, rope_parameters_from_config(config))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    # Without the factors the frequencies are the unscaled ones, so the test can fail.
    plain = compute_inv_freq(head_dim, {"rope_type": "default",
                                        "rope_theta": config.rope_parameters["rope_theta"]})
    assert not torch.allclose(plain, expected)


def test_linear_rope_scaling(tiny_model_factory, tiny_gguf_factory):
    config = gguf_hf_config(open_gguf(tiny_gguf_factory(
        "llama", "F16", rope_scaling={"rope_type": "linear", "factor": 4.0})))
    assert config.rope_parameters["rope_type"] == "linear"
    assert config.rope_parameters["factor"] == 4.0


def _write(path, arch: str, fields: dict, tensors: dict[str, np.ndarray]):
    writer = gguf.GGUFWriter(path, arch)
    for key, value in fields.items():
        if isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_end_of_generation_id_is_an_eos(tmp_path):
    fields = {"llama.embedding_length": 8, "llama.attention.head_count": 2,
              "llama.block_count": 1, "llama.feed_forward_length": 16,
              "llama.context_length": 64, "tokenizer.ggml.eos_token_id": 7,
              "tokenizer.ggml.eot_token_id": 9, "tokenizer.ggml.eom_token_id": 7}
    path = _write(tmp_path / "eog.gguf", "llama", fields,
                  {"token_embd.weight": np.zeros((16, 8), np.float32)})
    assert gguf_hf_config(open_gguf(path)).eos_token_id == [7, 9]


def test_unsupported_architecture_names_the_file(tmp_path):
    path = _write(tmp_path / "neox.gguf", "gptneox", {},
                  {"token_embd.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(UnsupportedModelError, match=r"neox.gguf: GGUF architecture 'gptneox'"):
        gguf_hf_config(open_gguf(path))


def test_missing_hyperparameter_names_the_key(tmp_path):
    path = _write(tmp_path / "bare.gguf", "llama", {"llama.embedding_length": 8},
                  {"token_embd.weight": np.zeros((4, 8), np.float32)})
    with pytest.raises(GGUFError, match=r"bare.gguf: metadata key 'llama.attention.head_count'"):
        gguf_hf_config(open_gguf(path))


def test_unsupported_rope_scaling_is_refused(tmp_path):
    fields = {"llama.embedding_length": 8, "llama.attention.head_count": 2,
              "llama.block_count": 1, "llama.feed_forward_length": 16,
              "llama.context_length": 64, "llama.rope.scaling.type": "longrope"}
    # LongRoPE without its factor tensors (only Phi-3's converter writes them).
    path = _write(tmp_path / "lr.gguf", "llama", fields,
                  {"token_embd.weight": np.zeros((16, 8), np.float32)})
    with pytest.raises(UnsupportedModelError, match="lr.gguf: rope scaling type 'longrope'"):
        gguf_hf_config(open_gguf(path))
    fields.update({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                   "llama.rope.scaling.original_context_length": 16,
                   "llama.rope.scaling.yarn_ext_factor": 0.5})
    path = _write(tmp_path / "yarn.gguf", "llama", fields,
                  {"token_embd.weight": np.zeros((16, 8), np.float32)})
    with pytest.raises(UnsupportedModelError, match="yarn.gguf: rope.scaling.yarn_ext_factor"):
        gguf_hf_config(open_gguf(path))
