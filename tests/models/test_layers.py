"""Rotary, RMSNorm and the fused linear layers against transformers' own implementations; the
linears on a packed weight (linear.set_packed) against quantized_linear."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (LlamaRMSNorm, LlamaRotaryEmbedding,
                                                      apply_rotary_pos_emb)

from mrv2.models.layers.linear import (Linear, MergedLinear, QKVLinear, RowParallelLinear,
                                       bfloat16_weight, set_packed)
from mrv2.models.layers.norm import RMSNorm
from mrv2.models.layers.quantized import PackedWeight, quantized_linear
from mrv2.models.layers.rotary import (RotaryEmbedding, compute_inv_freq,
                                       rope_parameters_from_config)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _llama_config(rope: dict | None = None, theta: float = 10000.0, **kw) -> LlamaConfig:
    rope_parameters = {"rope_type": "default", **(rope or {}), "rope_theta": theta}
    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, max_position_embeddings=256,
                       rope_parameters=rope_parameters, **kw)


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3],
                         ids=["default", "linear", "llama3"])
def test_rotary_matches_transformers(rope: dict | None) -> None:
    config = _llama_config(rope, theta=500000.0)
    ref = LlamaRotaryEmbedding(config)
    ours = RotaryEmbedding(16, 256, rope_parameters_from_config(config))
    assert torch.equal(compute_inv_freq(16, rope_parameters_from_config(config)), ref.inv_freq)

    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 5, 17, 63, 200, 255, 3])
    q = torch.randn(8, 4 * 16, generator=gen)
    k = torch.randn(8, 2 * 16, generator=gen)
    q_out, k_out = ours(positions, q, k)

    cos, sin = ref(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.view(1, 8, 4, 16).transpose(1, 2),
                                        k.view(1, 8, 2, 16).transpose(1, 2), cos, sin)
    torch.testing.assert_close(q_out, q_ref.transpose(1, 2).reshape(8, 64), atol=1e-6, rtol=0)
    torch.testing.assert_close(k_out, k_ref.transpose(1, 2).reshape(8, 32), atol=1e-6, rtol=0)


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.5}, LLAMA3],
                         ids=["linear", "llama3"])
def test_scaled_inv_freq_matches_rope_init_functions(rope: dict) -> None:
    config = _llama_config(rope)
    expected, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    assert attention_factor == 1.0
    ours = compute_inv_freq(16, rope_parameters_from_config(config))
    assert torch.equal(ours, expected)
    # The scaling must matter at this head size (else the model tests prove nothing).
    default = compute_inv_freq(16, {"rope_type": "default", "rope_theta": 10000.0})
    assert not torch.allclose(ours, default)


def test_rope_parameters_old_and_new_forms(tmp_path) -> None:
    # transformers 4.x attribute form (what a PretrainedConfig of that era exposes).
    old = SimpleNamespace(rope_theta=500000.0, max_position_embeddings=128,
                          rope_scaling={"type": "linear", "factor": 2.0})
    params = rope_parameters_from_config(old)
    assert params["rope_type"] == "linear" and params["rope_theta"] == 500000.0
    plain = SimpleNamespace(rope_theta=1e6, rope_scaling=None, max_position_embeddings=128)
    assert rope_parameters_from_config(plain) == {"rope_type": "default", "rope_theta": 1e6}
    # llama3 without original_max_position_embeddings falls back to max_position_embeddings.
    no_orig = SimpleNamespace(rope_theta=1.0, max_position_embeddings=128, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1, "high_freq_factor": 4})
    assert rope_parameters_from_config(no_orig)["original_max_position_embeddings"] == 128

    # An old-style config.json read by transformers 5: moved into `rope_parameters`.
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "num_attention_heads": 4, "num_hidden_layers": 1, "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = AutoConfig.from_pretrained(tmp_path)
    params = rope_parameters_from_config(config)
    assert params["rope_type"] == "llama3" and params["rope_theta"] == 500000.0
    assert params["original_max_position_embeddings"] == 16


@pytest.mark.parametrize("rope_type", ["mrope", "su"])
def test_unsupported_rope_type_raises(rope_type: str) -> None:
    with pytest.raises(ValueError, match="supported rope types: default, linear, llama3"):
        compute_inv_freq(16, {"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = 1 + 0.1 * torch.randn(64, generator=gen)
    ref = LlamaRMSNorm(64, eps=1e-5)
    ours = RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(weight)
        ours.weight.copy_(weight)
    ref, ours = ref.to(dtype), ours.to(dtype)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    residual = torch.randn(5, 64, generator=gen).to(dtype)
    assert torch.equal(ours(x), ref(x))
    normed, new_residual = ours(x, residual)
    assert torch.equal(new_residual, residual + x)
    assert torch.equal(normed, ref(residual + x))


def test_qkv_linear_shards() -> None:
    layer = QKVLinear(hidden_size=8, head_dim=2, num_heads=4, num_kv_heads=2, bias=True)
    assert layer.weight.shape == (16, 8) and layer.weight.shard_ids == ("q", "k", "v")
    wq, wk, wv = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    bq, bk, bv = torch.randn(8), torch.randn(4), torch.randn(4)
    for sid, w, b in (("v", wv, bv), ("q", wq, bq), ("k", wk, bk)):  # any order
        layer.weight.weight_loader(layer.weight, w, sid)
        layer.bias.weight_loader(layer.bias, b, sid)
    assert layer.shard_range("k") == (8, 4)
    x = torch.randn(3, 8)
    q, k, v = layer.forward_split(x)
    torch.testing.assert_close(q, x @ wq.T + bq)
    torch.testing.assert_close(k, x @ wk.T + bk)
    torch.testing.assert_close(v, x @ wv.T + bv)
    with pytest.raises(ValueError, match="shard 'k'.*shape"):
        layer.weight.weight_loader(layer.weight, torch.randn(8, 8), "k")
    with pytest.raises(ValueError, match="unknown shard"):
        layer.weight.weight_loader(layer.weight, wq, "o")


def test_merged_and_plain_linear() -> None:
    merged = MergedLinear(6, [5, 5])
    gate, up = torch.randn(5, 6), torch.randn(5, 6)
    merged.weight.weight_loader(merged.weight, up, 1)
    merged.weight.weight_loader(merged.weight, gate, 0)
    x = torch.randn(2, 6)
    torch.testing.assert_close(merged(x), torch.cat([x @ gate.T, x @ up.T], dim=-1))
    plain = Linear(6, 3)
    assert plain.bias is None
    w = torch.randn(3, 6, dtype=torch.float64)  # converted on load
    plain.weight.weight_loader(plain.weight, w)
    assert plain.weight.dtype == torch.float32
    torch.testing.assert_close(plain(x), x @ w.float().T)
    with pytest.raises(ValueError, match="shape"):
        plain.weight.weight_loader(plain.weight, torch.randn(6, 3))


@pytest.mark.parametrize("cls", [Linear, MergedLinear, RowParallelLinear])
@torch.no_grad()
def test_a_packed_weight_is_what_the_linear_computes_on(cls) -> None:
    """`set_packed`: the layer's own forward multiplies by the packed weight (quantized_linear,
    its bias added as stored) and the float weight it was loaded into is released."""
    layer = (MergedLinear(64, [32, 32], bias=True) if cls is MergedLinear
             else cls(64, 48, bias=True))
    g = torch.Generator().manual_seed(0)
    layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))
    layer.bias.copy_(torch.randn(layer.bias.shape, generator=g))
    assert layer.packed is None
    packed = PackedWeight.from_float(layer.weight, torch.float16)
    set_packed(layer, packed)
    assert layer.packed is packed and layer.weight.numel() == 0
    x = torch.randn(2, 3, 64, generator=g)  # leading dims kept
    out = layer(x)
    assert out.shape == (2, 3, packed.out_features)
    expected = quantized_linear(x.reshape(6, 64), packed, layer.bias).reshape(2, 3, -1)
    assert torch.equal(out, expected)


def test_bfloat16_weight_is_a_bias_free_projections_packed_bfloat16() -> None:
    def packed(dtype: torch.dtype, bias: bool) -> Linear:
        layer = Linear(32, 16, bias=bias)
        torch.nn.init.normal_(layer.weight)
        set_packed(layer, PackedWeight.from_float(layer.weight, dtype))
        return layer

    layer = packed(torch.bfloat16, bias=False)
    assert bfloat16_weight(layer) is layer.packed
    assert bfloat16_weight(packed(torch.float16, bias=False)) is None
    assert bfloat16_weight(packed(torch.bfloat16, bias=True)) is None
    assert bfloat16_weight(Linear(32, 16)) is None  # float32, nothing packed
