"""mrv2/testing/tiny_eagle.py: the heads it writes and the mirror head's target."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mrv2.testing.tiny_eagle import make_eagle_head, mirror_ready_target


def test_random_head_has_eagles_tensors(tiny_model_factory, tiny_gguf_factory, tmp_path):
    """From a directory or a GGUF file: fc [hidden, 2 hidden], Llama layers without the
    first layer's input norm, a config of the head's layers."""
    for i, target in enumerate((tiny_model_factory("llama"), tiny_gguf_factory("llama"))):
        head = make_eagle_head(tmp_path / f"head{i}", target, num_layers=2)
        tensors = load_file(str(head / "model.safetensors"))
        assert tensors["fc.weight"].shape == (64, 128)
        assert "layers.0.input_layernorm.weight" not in tensors
        assert "layers.1.input_layernorm.weight" in tensors
        config = json.loads((head / "config.json").read_text())
        assert config["num_hidden_layers"] == 2
        assert config["architectures"] == ["LlamaForCausalLM"]


def test_mirror_head_copies_the_one_layer_of_a_ready_target(tiny_model_factory, tmp_path):
    source = tiny_model_factory("llama", num_layers=1)
    target = mirror_ready_target(tmp_path / "target", source)
    weights = load_file(str(target / "model.safetensors"))
    assert torch.equal(weights["model.norm.weight"], torch.ones(64))
    rms = weights["model.embed_tokens.weight"].pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms))
    head = load_file(str(make_eagle_head(tmp_path / "head", target, mirror=True)
                         / "model.safetensors"))
    assert torch.equal(head["fc.weight"][:, :64], torch.eye(64))
    assert not head["fc.weight"][:, 64:].any()
    assert torch.equal(head["layers.0.mlp.down_proj.weight"],
                       weights["model.layers.0.mlp.down_proj.weight"])
    with pytest.raises(ValueError, match="one layer"):
        make_eagle_head(tmp_path / "bad", tiny_model_factory("llama"), mirror=True)
