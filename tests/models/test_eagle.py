"""The EAGLE-1 head (models/eagle.py) against EAGLE's computation written out in torch, and its
checkpoint forms."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mrv2.attention import AttentionMetadata
from mrv2.config import ModelConfig
from mrv2.models import load_hf_config, load_model
from mrv2.models.eagle import EagleLlamaForCausalLM
from mrv2.testing.tiny_eagle import make_eagle_head

BLOCK = 16


def _load(path) -> EagleLlamaForCausalLM:
    config = ModelConfig(model=str(path), dtype=torch.float32, max_model_len=64,
                         hf_config=load_hf_config(str(path)))
    return load_model(config, torch.device("cpu"), EagleLlamaForCausalLM)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x: torch.Tensor, pos: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.cat([pos[:, None].float() * inv] * 2, -1)[:, None, :]
    half = torch.cat((-x[..., dim // 2:], x[..., :dim // 2]), -1)
    return x * angles.cos() + half * angles.sin()


def reference(path, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """EAGLE's head over one sequence from position 0: fc, then its Llama layers (the first
    without input norm), causal attention, the residual stream unnormed."""
    w = load_file(str(path / "model.safetensors"))
    hf = json.loads((path / "config.json").read_text())
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    dim, eps = hf["hidden_size"] // heads, hf["rms_norm_eps"]
    theta = hf.get("rope_parameters", {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    x = torch.cat((embeds, features), -1) @ w["fc.weight"].T
    pos = torch.arange(x.shape[0])
    residual = None
    for i in range(hf["num_hidden_layers"]):
        p = f"layers.{i}."
        residual = x if residual is None else residual + x
        h = residual if i == 0 else _rms(residual, w[p + "input_layernorm.weight"], eps)
        q = _rotate((h @ w[p + "self_attn.q_proj.weight"].T).view(-1, heads, dim), pos, dim, theta)
        k = _rotate((h @ w[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, dim), pos, dim,
                    theta)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, dim)
        k, v = (t.repeat_interleave(heads // kv_heads, 1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) * dim ** -0.5
        scores = scores.masked_fill(torch.ones_like(scores[0]).triu(1).bool(), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(x.shape[0], -1)
        residual = residual + attn @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(residual, w[p + "post_attention_layernorm.weight"], eps)
        x = (torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T)
             * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return x + residual


def _prefill_meta(n: int) -> AttentionMetadata:
    qsl, seq = np.array([0, n], np.int32), np.array([n], np.int32)
    blocks = -(-n // BLOCK)
    return AttentionMetadata(
        num_actual_tokens=n, num_reqs=1, num_decodes=0, query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(n), query_start_loc_np=qsl, seq_lens_np=seq, max_seq_len=n)


def head_inputs(head, feature_width: int, n: int = 21, hidden: int = 64
                ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Random embeddings [n, hidden] and features [n, feature_width] for a prompt of n tokens
    from position 0, and an empty KV cache per layer of `head`."""
    gen = torch.Generator().manual_seed(0)
    attention = head.layers[0].self_attn
    caches = [torch.zeros(2, 4, BLOCK, attention.num_kv_heads, attention.head_dim)
              for _ in head.layers]
    return (torch.randn(n, hidden, generator=gen), torch.randn(n, feature_width, generator=gen),
            caches)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_head_matches_eagle_written_out(tiny_model_factory, tmp_path, num_layers):
    target = tiny_model_factory("llama")
    path = make_eagle_head(tmp_path / "head", target, seed=5, num_layers=num_layers)
    head = _load(path)
    embeds, features, caches = head_inputs(head, 64)
    with torch.no_grad():
        out = head(embeds, features, torch.arange(21), caches, _prefill_meta(21))
    torch.testing.assert_close(out, reference(path, embeds, features), atol=2e-5, rtol=2e-5)
    assert head.embed_tokens is None and head.lm_head is None  # the target's are used


def test_model_prefix_fc_bias_and_own_embeddings_load(tiny_model_factory, tmp_path):
    """`model.`-prefixed names (some exports), an `fc.bias`, and a head's own embedding and
    LM head load into the head; a tensor it has no place for is refused by name."""
    target = tiny_model_factory("llama")
    path = make_eagle_head(tmp_path / "head", target, seed=1)
    tensors = {f"model.{k}": v for k, v in load_file(str(path / "model.safetensors")).items()}
    tensors["model.fc.bias"] = torch.full((64,), 0.5)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    tensors["model.embed_tokens.weight"] = torch.randn(vocab, 64)
    tensors["lm_head.weight"] = torch.randn(vocab, 64)
    save_file(tensors, str(path / "model.safetensors"))
    head = _load(path)
    assert torch.equal(head.fc.bias, torch.full((64,), 0.5))
    assert torch.equal(head.embed_tokens.weight[:vocab], tensors["model.embed_tokens.weight"])
    assert head.next_tokens(torch.ones(3, 64), None).shape == (3,)  # its own LM head's
    tensors["midlayer.hidden_norm.weight"] = torch.ones(64)  # EAGLE-3's: not this head's
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="midlayer.hidden_norm.weight"):
        _load(path)
