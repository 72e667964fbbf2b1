"""Gemma 4 (models/gemma4.py) beyond the logits tests (test_llama.py "gemma4") and the end-to-end
ones (tests/entrypoints/test_llm_architectures.py): what it declares, what it refuses, and the
checkpoint tensors of KV-shared layers it skips."""

from __future__ import annotations

import pytest
import torch

from mrv2.config import ModelConfig
from mrv2.models import load_hf_config, load_model
from mrv2.models.cpu import decode

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
CONFIG = {"sliding_window": 4, "layer_types": LAYER_TYPES, "global_head_dim": 32,
          "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 2048,
          "num_kv_shared_layers": 2}


def _model_config(path, **overrides) -> ModelConfig:
    hf = load_hf_config(str(path))
    for key, value in overrides.items():
        setattr(hf, key, value)
    return ModelConfig(model=str(path), dtype=torch.float32, max_model_len=64, hf_config=hf)


def test_declares_its_traits_and_the_fused_stack_runs_them(tiny_model_factory) -> None:
    model = load_model(_model_config(tiny_model_factory("gemma4", num_layers=4, config=CONFIG)),
                       torch.device("cpu"))
    spec = model.decoder_spec
    assert spec.value_norm and spec.per_layer_input_size == 8
    assert spec.kv_sources == (0, 1, 0, 1) and spec.attention_scale == 1.0
    assert decode.supports(spec) and decode.fused_decode(model) is not None
    # KV-shared layers project queries only; their sources' caches hold their keys.
    assert model.model.layers[2].self_attn.qkv_proj.shard_sizes.keys() == {"q"}
    assert model.model.layers[1].self_attn.qkv_proj.shard_sizes.keys() == {"q", "k", "v"}


@pytest.mark.parametrize("field", ["enable_moe_block", "use_bidirectional_attention"])
def test_unimplemented_fields_are_refused_by_name(tiny_model_factory, field) -> None:
    path = tiny_model_factory("gemma4", num_layers=4, config=CONFIG)
    with pytest.raises(ValueError, match=field):
        load_model(_model_config(path, **{field: True if field == "enable_moe_block"
                                          else "all"}), torch.device("cpu"))


def test_shared_layers_key_tensors_in_a_checkpoint_are_skipped(tiny_model_factory) -> None:
    """Released checkpoints keep k_proj / v_proj / k_norm in the KV-shared layers (transformers
    ignores them): loading them is not an error, and nothing reads them."""
    path = tiny_model_factory("gemma4", num_layers=4, config=CONFIG)
    model = load_model(_model_config(path), torch.device("cpu"))
    extra = [("model.layers.3.self_attn.k_proj.weight", torch.zeros(32, 64)),
             ("model.layers.3.self_attn.k_norm.weight", torch.zeros(32))]
    assert model.load_weights(extra) == set()
    with pytest.raises(ValueError, match="no matching parameter"):
        model.load_weights([("model.layers.1.self_attn.q_bias.weight", torch.zeros(4))])
