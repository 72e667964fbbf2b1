"""Gemma 2 and Gemma 3 (text): the Llama family's blocks with Gemma's traits declared.

Each layer normalises before and after each sublayer (input / post-attention, pre- / post-
feedforward norms) and adds the normalised output to the residual stream; every norm
multiplies by 1 + w in float32 (`RMSNorm(unit_offset=True)`); the embeddings are scaled by
sqrt(hidden_size) rounded to the activation dtype; attention scores by
query_pre_attn_scalar ** -0.5; the MLP is GeLU(tanh)-gated; layers alternate sliding-window
and global attention as `layer_types` says. Gemma 3 adds per-head q/k norms and rotates its
windowed layers with their own rope parameters (`rope_parameters["sliding_attention"]`).
Gemma 2's attention and final-logit soft-capping (tanh(x / cap) * cap) are declared too (Gemma 3
applies the final one only, as transformers does).
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
from mrv2.models.layers.norm import RMSNorm, pre_norm
from mrv2.models.layers.rotary import RotaryInputs, per_layer_type_rope
from mrv2.models.llama import LlamaAttention, LlamaForCausalLM


class GemmaDecoderLayer(nn.Module):
    def __init__(self, model_config: ModelConfig, spec: DecoderSpec, layer: int) -> None:
        super().__init__()
        hf = model_config.hf_config
        self.self_attn = LlamaAttention(model_config, spec, layer)
        self.mlp = GatedMLP(hf.hidden_size, hf.intermediate_size, spec.mlp_bias, spec.activation)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(hf.hidden_size, hf.rms_norm_eps, unit_offset=True))

    def forward(self, rope: RotaryInputs, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's normalised MLP output, the residual stream before adding it)."""
        hidden, residual = pre_norm(self.input_layernorm, hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(rope, hidden, kv_cache, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_class = GemmaDecoderLayer

    def declare(self, hf: Any) -> DecoderSpec:
        if getattr(hf, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True (an embedding model's "
                             "attention) is not supported")
        return dataclasses.replace(
            super().declare(hf), qkv_bias=bool(getattr(hf, "attention_bias", False)),
            o_bias=bool(getattr(hf, "attention_bias", False)), norm_unit_offset=True,
            sandwich_norms=True,
            embedding_scale=hf.hidden_size ** 0.5,
            attention_scale=hf.query_pre_attn_scalar ** -0.5,
            attention_softcap=getattr(hf, "attn_logit_softcapping", None),
            logit_softcap=getattr(hf, "final_logit_softcapping", None))


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True

    def declare(self, hf: Any) -> DecoderSpec:
        per_type = per_layer_type_rope(getattr(hf, "rope_parameters", None))
        # transformers' Gemma3Attention keeps attn_logit_softcapping but never applies it (the
        # released configs set it null); the final-logit cap applies.
        return dataclasses.replace(super().declare(hf), local_rope=per_type,
                                   attention_softcap=None)
