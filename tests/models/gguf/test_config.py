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


def write_file(path, arch: str, fields: dict, tensors: dict):
    """A GGUF file of these metadata fields (ints as uint32, floats as float32, bools,
    strings, lists as arrays) and tensors (numpy arrays, or another file's records as stored)."""
    writer = gguf.GGUFWriter(path, arch)
    for key, value in fields.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    for name, tensor in tensors.items():
        if isinstance(tensor, np.ndarray):
            writer.add_tensor(name, tensor)
        else:
            writer.add_tensor(name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
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
    path = write_file(tmp_path / "eog.gguf", "llama", fields,
                  {"token_embd.weight": np.zeros((16, 8), np.float32)})
    assert gguf_hf_config(open_gguf(path)).eos_token_id == [7, 9]


def test_unsupported_architecture_names_the_file(tmp_path):
    path = write_file(tmp_path / "neox.gguf", "gptneox", {},
                  {"token_embd.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(UnsupportedModelError, match=r"neox.gguf: GGUF architecture 'gptneox'"):
        gguf_hf_config(open_gguf(path))


def test_missing_hyperparameter_names_the_key(tmp_path):
    path = write_file(tmp_path / "bare.gguf", "llama", {"llama.embedding_length": 8},
                  {"token_embd.weight": np.zeros((4, 8), np.float32)})
    with pytest.raises(GGUFError, match=r"bare.gguf: metadata key 'llama.attention.head_count'"):
        gguf_hf_config(open_gguf(path))


def test_unsupported_rope_scaling_is_refused(tmp_path):
    fields = {"llama.embedding_length": 8, "llama.attention.head_count": 2,
              "llama.block_count": 1, "llama.feed_forward_length": 16,
              "llama.context_length": 64, "llama.rope.scaling.type": "longrope"}
    # LongRoPE without its factor tensors (only Phi-3's converter writes them).
    path = write_file(tmp_path / "lr.gguf", "llama", fields,
                  {"token_embd.weight": np.zeros((16, 8), np.float32)})
    with pytest.raises(UnsupportedModelError, match="lr.gguf: rope scaling type 'longrope'"):
        gguf_hf_config(open_gguf(path))
    fields.update({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                   "llama.rope.scaling.original_context_length": 16,
                   "llama.rope.scaling.yarn_ext_factor": 0.5})
    path = write_file(tmp_path / "yarn.gguf", "llama", fields,
                  {"token_embd.weight": np.zeros((16, 8), np.float32)})
    with pytest.raises(UnsupportedModelError, match="yarn.gguf: rope.scaling.yarn_ext_factor"):
        gguf_hf_config(open_gguf(path))


GEMMA4 = {"num_layers": 5, "config": {
    "sliding_window": 5, "layer_types": ["sliding_attention", "sliding_attention",
                                         "full_attention", "sliding_attention", "full_attention"],
    "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 512,
    "num_kv_shared_layers": 2, "use_double_wide_mlp": True, "final_logit_softcapping": 10.0,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1e6}}}}


def test_gemma4_config_equals_the_source_config(tiny_model_factory, tiny_gguf_factory):
    """Per-layer arrays, the SWA head size, the rope_freqs tensor and the tensors present
    (no attn_v: k = v) give back transformers' config of the source checkpoint."""
    source = AutoConfig.from_pretrained(tiny_model_factory("gemma4", **GEMMA4))
    config = gguf_hf_config(open_gguf(tiny_gguf_factory("gemma4", "F32", **GEMMA4)))
    for field in ("layer_types", "num_kv_shared_layers", "use_double_wide_mlp",
                  "attention_k_eq_v", "hidden_size_per_layer_input", "sliding_window",
                  "vocab_size_per_layer_input", "final_logit_softcapping", "intermediate_size",
                  "architectures"):
        assert getattr(config, field) == getattr(source, field), field
    for layer in range(5):
        for field in ("head_dim", "num_key_value_heads"):
            assert (getattr(config.per_layer_config[layer], field)
                    == getattr(source.per_layer_config[layer], field)), (layer, field)
    assert config.rope_parameters == source.rope_parameters


def _copy_gguf(src, dst, fields: dict, drop: tuple[str, ...] = (),
               tensors: dict[str, np.ndarray] | None = None):
    """The file at src with some metadata replaced, tensors dropped or added."""
    ckpt = open_gguf(src)
    kept = {key: value for key, value in {**ckpt.fields, **fields}.items()
            if not key.startswith("GGUF.") and key != "general.architecture"}
    records = {name: record for name, record in ckpt.tensors.items() if name not in drop}
    return write_file(dst, ckpt.architecture, kept, {**records, **(tensors or {})})


@pytest.mark.parametrize("fields,tensors,match", [
    ({"gemma4.feed_forward_length": [128, 256, 128, 256, 256]}, {},
     "neither one width nor double width"),
    ({"gemma4.attention.head_count_kv": [2, 1, 1, 2, 1]}, {},
     "head_count_kv differing between layers of one type"),
    ({"gemma4.attention.value_length": 16}, {}, "value lengths"),
    ({}, {"rope_freqs.weight": np.arange(1, 17, dtype=np.float32)}, "rope_freqs"),
])
def test_gemma4_keys_mrv2_does_not_implement_are_refused(tiny_gguf_factory, tmp_path, fields,
                                                         tensors, match):
    path = _copy_gguf(tiny_gguf_factory("gemma4", "F32", **GEMMA4), tmp_path / "g4.gguf",
                      fields, drop=tuple(tensors), tensors=tensors)
    with pytest.raises(UnsupportedModelError, match=f"g4.gguf: .*{match}"):
        gguf_hf_config(open_gguf(path))


def test_gemma4_experts_and_per_layer_arrays_elsewhere_are_named(tiny_gguf_factory, tmp_path):
    """A Gemma 4 file with a router says enable_moe_block (which the model refuses by name);
    per-layer arrays on an architecture without them are refused."""
    path = _copy_gguf(tiny_gguf_factory("gemma4", "F32", **GEMMA4), tmp_path / "moe.gguf", {},
                      tensors={"blk.0.ffn_gate_inp.weight": np.zeros((4, 64), np.float32)})
    assert gguf_hf_config(open_gguf(path)).enable_moe_block is True
    fields = {"llama.embedding_length": 8, "llama.attention.head_count": 2,
              "llama.block_count": 2, "llama.feed_forward_length": 16,
              "llama.context_length": 64}
    path = write_file(tmp_path / "arr.gguf", "llama", fields,
                  {"token_embd.weight": np.zeros((16, 8), np.float32)})
    path = _copy_gguf(path, tmp_path / "arr2.gguf", {"llama.attention.head_count_kv": [2, 1]})
    with pytest.raises(UnsupportedModelError, match="arr2.gguf: per-layer head_count_kv"):
        gguf_hf_config(open_gguf(path))
