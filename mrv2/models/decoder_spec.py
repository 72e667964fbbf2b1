"""What a decoder-only model declares about itself for the fast paths that read it.

A model class sets `decoder_spec` when it is built; mrv2/models/cpu runs its fused decode
stack for a model whose spec it supports (`decode.supports`) and the module path otherwise.
Nothing is inferred from the modules' types or replaced on them: the spec is the contract.

The module layout a spec promises is the Llama family's: `model.embed_tokens`,
`model.layers[i]` with `input_layernorm`, `self_attn` (`qkv_proj`, `o_proj`, optional
per-head `q_norm` / `k_norm`, `attn`), `post_attention_layernorm`, `mlp` (a layers.mlp
`GatedMLP`), then `model.norm`, `model.rotary_emb`, and `lm_head` unless the embeddings are
tied.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderSpec:
    qkv_bias: bool  # q/k/v projections have a bias
    o_bias: bool  # the attention output projection has a bias
    qk_norm: bool  # per-head RMSNorm of q and k before rotary (Qwen3)
    mlp_bias: bool  # the MLP's projections have biases
    activation: str = "silu"  # the gated MLP's activation
    tied_embeddings: bool = False  # the LM head multiplies by the embedding's table

    @property
    def has_biases(self) -> bool:
        return self.qkv_bias or self.o_bias or self.mlp_bias
