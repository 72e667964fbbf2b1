"""rotary.py's scalings against transformers' ROPE_INIT_FUNCTIONS (YaRN, dynamic NTK,
LongRoPE, partial rotary: bit-identical frequencies and attention factors, at the sequence
length the engine fixes them at), and partial rotary applied on every path (torch, numba,
Triton interpreted) against transformers' Phi-3 `apply_rotary_pos_emb`."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from mrv2 import platform
from mrv2.models.layers.rotary import (RotaryEmbedding, apply_rotary_qk, attention_factor,
                                       compute_inv_freq, rope_parameters_from_config,
                                       rotary_dim)

HEAD_DIM = 32
SHORT = [1.0 + 0.1 * i for i in range(HEAD_DIM // 4)]  # 0.5 partial: 16 dims, 8 factors
LONG = [2.0 + 0.5 * i for i in range(HEAD_DIM // 4)]


def _config(rope: dict, partial: float = 0.5) -> Phi3Config | LlamaConfig:
    """Phi-3's config for LongRoPE and plain rotary (it reads "yarn" as LongRoPE, Phi-3's old
    name), Llama's for the others; head_dim 32 either way."""
    shape = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=256)
    if rope["rope_type"] in ("longrope", "default"):
        return Phi3Config(**shape, partial_rotary_factor=partial,
                          original_max_position_embeddings=rope.get(
                              "original_max_position_embeddings", 256),
                          rope_parameters={"rope_theta": 10000.0, **rope})
    return LlamaConfig(**shape, rope_parameters={"rope_theta": 10000.0,
                                                 "partial_rotary_factor": partial, **rope})


SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "yarn-untruncated": {"rope_type": "yarn", "factor": 3.0, "truncate": False,
                         "original_max_position_embeddings": 64},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                 "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("max_model_len", [48, 256, 1024])
def test_frequencies_and_attention_factor_equal_transformers(name, max_model_len):
    config = _config(SCALINGS[name])
    params = rope_parameters_from_config(config)
    rope_type = params["rope_type"]
    # transformers at a sequence of max_model_len tokens (its init length for the others).
    seq_len = max_model_len if rope_type in ("dynamic", "longrope") else None
    expected, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    ours = compute_inv_freq(HEAD_DIM, params, max_model_len)
    assert ours.shape == (rotary_dim(HEAD_DIM, params) // 2,) == (8,)
    assert torch.equal(ours, expected.float())
    assert attention_factor(params) == pytest.approx(factor, rel=0, abs=0)
    plain = compute_inv_freq(HEAD_DIM, {**params, "rope_type": "default"})
    if rope_type != "dynamic" or max_model_len > 256:  # dynamic is plain within the context
        assert not torch.equal(ours, plain)


def test_longrope_switches_factors_past_the_original_context():
    params = rope_parameters_from_config(_config(SCALINGS["longrope"]))
    short = compute_inv_freq(HEAD_DIM, params, 64)
    long = compute_inv_freq(HEAD_DIM, params, 65)
    assert not torch.equal(short, long)
    # Phi-3's default attention factor: from max_position_embeddings / original (256 / 64).
    assert attention_factor(params) > 1.0


@pytest.mark.parametrize("partial", [0.5, 0.75, 1.0])
@pytest.mark.parametrize("impl", ["torch", "numba", "triton"])
def test_partial_rotary_equals_phi3(partial, impl):
    config = _config(SCALINGS["longrope"], partial=partial) if partial == 0.5 else _config(
        {"rope_type": "default"}, partial=partial)
    ref = Phi3RotaryEmbedding(config)
    ours = RotaryEmbedding(HEAD_DIM, 256, rope_parameters_from_config(config), 256)
    assert ours.rotary_dim == int(HEAD_DIM * partial)
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 7, 63, 64, 200, 255])
    q = torch.randn(7, 4 * HEAD_DIM, generator=gen)
    k = torch.randn(7, 2 * HEAD_DIM, generator=gen)
    dtype = torch.float64 if impl == "torch" else torch.float32  # float64 skips numba
    cos, sin = ours.get_cos_sin(positions, dtype)
    if impl == "triton":
        with platform.triton_interpreter():
            q_out, k_out = apply_rotary_qk(q, k, cos, sin, HEAD_DIM)
    else:
        q_out, k_out = apply_rotary_qk(q.to(dtype), k.to(dtype), cos, sin, HEAD_DIM)
    ref_cos, ref_sin = ref(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.view(1, 7, 4, HEAD_DIM).transpose(1, 2),
                                        k.view(1, 7, 2, HEAD_DIM).transpose(1, 2),
                                        ref_cos, ref_sin)
    torch.testing.assert_close(q_out.float(), q_ref.transpose(1, 2).reshape(7, -1),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(k_out.float(), k_ref.transpose(1, 2).reshape(7, -1),
                               atol=1e-6, rtol=0)
    rotary = int(HEAD_DIM * partial)
    assert torch.equal(q_out.float().view(7, 4, HEAD_DIM)[..., rotary:],
                       q.view(7, 4, HEAD_DIM)[..., rotary:])  # passed through


def test_bad_partial_factors_and_factor_lists_are_refused():
    with pytest.raises(ValueError, match="rotary dimensions"):
        rotary_dim(HEAD_DIM, {"partial_rotary_factor": 0.01})
    params = {**rope_parameters_from_config(_config(SCALINGS["longrope"])),
              "partial_rotary_factor": 1.0}
    with pytest.raises(ValueError, match="short_factor has 8 entries; 16 expected"):
        compute_inv_freq(HEAD_DIM, params, 64)


def test_rope_parameters_mrv2_does_not_read_are_refused_by_name():
    from types import SimpleNamespace

    from mrv2.models.layers.rotary import rope_parameters_from_config

    hf = SimpleNamespace(rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                          "original_max_position_embeddings": 8,
                                          "yarn_temperature": 0.5},
                         max_position_embeddings=64)
    with pytest.raises(ValueError, match="yarn_temperature"):
        rope_parameters_from_config(hf)


def test_position_query_scale_is_one_within_the_original_context():
    from mrv2.models.layers.rotary import position_query_scale

    scale = position_query_scale(torch.tensor([0, 7, 8, 23, 24]), 0.5, 8)
    expected = [1.0, 1.0, 1 + 0.5 * math.log(2), 1 + 0.5 * math.log(3), 1 + 0.5 * math.log(4)]
    assert scale.shape == (5, 1)
    assert scale[:, 0].tolist() == pytest.approx(expected, rel=1e-6)


def test_proportional_rope_equals_transformers_and_rotates_the_whole_head():
    """Gemma 4's global layers: the first partial_rotary_factor of the angles turn (as over the
    whole head), the rest have frequency 0; the table spans the whole head."""
    from transformers import Gemma4TextConfig

    config = Gemma4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=2, head_dim=8,
                              global_head_dim=32, hidden_size_per_layer_input=0,
                              layer_types=["sliding_attention", "full_attention"])
    expected, factor = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu",
                                                           layer_type="full_attention")
    params = rope_parameters_from_config(config, "full_attention")
    assert params["rope_type"] == "proportional" and params["partial_rotary_factor"] == 0.25
    assert rotary_dim(32, params) == 32 and factor == 1.0
    ours = compute_inv_freq(32, params)
    assert torch.equal(ours, expected.float())
    assert (ours[4:] == 0).all() and (ours[:4] > 0).all()
