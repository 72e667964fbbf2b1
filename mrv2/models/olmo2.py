"""OLMo 2: the Llama family's attention and MLP with the norms moved after them.

Each sublayer's output is RMS-normalised before it joins the residual stream
(`post_attention_layernorm`, `post_feedforward_layernorm`) and nothing is normalised before a
sublayer; q and k are normalised over their whole projections (all heads at once, not per
head) before rotary. Both are declared in the DecoderSpec (`norms_after`,
`qk_norm_over_projection`); the attention is llama.py's.

Numerics: transformers' Olmo2RMSNorm multiplies by the weight in float32 and rounds once, where
Llama's rounds the normalised value first; mrv2's RMSNorm takes Llama's order, so 16-bit runs
differ from transformers by up to an ulp per norm (float32 is exact).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from mrv2.attention import AttentionMetadata
from mrv2.config import ModelConfig
from mrv2.models.decoder_spec import DecoderSpec
from mrv2.models.layers.mlp import GatedMLP
from mrv2.models.layers.norm import RMSNorm
from mrv2.models.layers.rotary import RotaryInputs
from mrv2.models.llama import LlamaAttention, LlamaForCausalLM


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, model_config: ModelConfig, spec: DecoderSpec, layer: int) -> None:
        super().__init__()
        hf = model_config.hf_config
        self.self_attn = LlamaAttention(model_config, spec, layer)
        self.mlp = GatedMLP(hf.hidden_size, hf.intermediate_size, spec.mlp_bias, spec.activation)
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)

    def forward(self, rope: RotaryInputs, hidden: torch.Tensor,
                residual: None, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, None]:
        """`hidden` is the residual stream itself: returns (the stream after this layer, None)."""
        attn = self.self_attn(rope, hidden, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden)), None


class Olmo2ForCausalLM(LlamaForCausalLM):
    layer_class = Olmo2DecoderLayer

    def declare(self, hf: Any) -> DecoderSpec:
        return dataclasses.replace(super().declare(hf), qk_norm_over_projection=True,
                                   norms_after=True)
