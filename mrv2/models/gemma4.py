"""Gemma 4 (text): Gemma 3's layers with the traits transformers' Gemma4TextModel adds.

- Global (full-attention) layers may have wider heads and their own kv head count
  (`per_layer_config`: `global_head_dim`, `num_global_key_value_heads`); they rotate with
  "proportional" RoPE (layers/rotary.py), the windowed ones with the default.
- Attention scores are not scaled (scale 1: the q/k norms set their size); values are
  RMS-normalised per head without a weight; with `attention_k_eq_v` a global layer's values
  are its keys' projection (no v_proj).
- The last `num_kv_shared_layers` layers compute no keys or values: each reads the cache of
  the last earlier layer of its type (core/kv_cache_layout.py `layer_kv_sources`), and with
  `use_double_wide_mlp` has an MLP twice as wide.
- Per-layer inputs: a second embedding table gives each token a small vector per layer, mixed
  with a projection of the token's embedding; each layer gates it into its output.
- Norms multiply by w (not Gemma 3's 1 + w); every layer's output is scaled by its loaded
  `layer_scalar`; final logits soft-capped as Gemma 2's.

MoE blocks (`enable_moe_block`) and bidirectional attention are refused by name. The fused CPU
decode stack runs Gemma 4 from what it declares (DecoderSpec.value_norm, per_layer_input_size,
kv_sources; its attention's `projections` and `layer_scalar`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.attention import Attention, AttentionMetadata
from mrv2.config import ModelConfig
from mrv2.core.kv_cache_layout import layer_kv_shape, layer_kv_sources
from mrv2.models.decoder_spec import DecoderSpec
from mrv2.models.layers.linear import (Linear, QKVLinear, RowParallelLinear,
                                      default_weight_loader, set_weight_attrs)
from mrv2.models.layers.mlp import GatedMLP
from mrv2.models.layers.norm import RMSNorm
from mrv2.models.layers.rotary import RotaryInputs, apply_rotary, apply_rotary_qk
from mrv2.models.layers.vocab_embedding import VocabParallelEmbedding
from mrv2.models.llama import LlamaForCausalLM, LlamaModel

# Tensors a KV-shared layer's checkpoint may still carry (transformers ignores them too).
_SHARED_LAYER_UNUSED = ("self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm.",
                        "self_attn.v_norm.")


def _value_norm(v: torch.Tensor, head_dim: int, eps: float) -> torch.Tensor:
    """RMSNorm of each head of v [T, KV*D] without a weight, in float32 (Gemma4RMSNorm's
    `with_scale=False`)."""
    h = v.reshape(v.shape[0], -1, head_dim).to(torch.float32)
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return h.to(v.dtype).reshape(v.shape)


class Gemma4Attention(nn.Module):
    def __init__(self, model_config: ModelConfig, spec: DecoderSpec, layer: int) -> None:
        super().__init__()
        hf = model_config.hf_config
        self.source = layer if spec.kv_sources is None else spec.kv_sources[layer]
        kv_heads, self.head_dim = layer_kv_shape(hf, self.source)
        window = spec.window(layer)
        k_eq_v = bool(getattr(hf, "attention_k_eq_v", False)) and not window
        owns_kv = self.source == layer
        self.qkv_proj = QKVLinear(hf.hidden_size, self.head_dim, hf.num_attention_heads,
                                  kv_heads, bias=spec.qkv_bias,
                                  projections=("qk" if k_eq_v else "qkv") if owns_kv
                                  else "q")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(hf.num_attention_heads * self.head_dim, hf.hidden_size,
                                        bias=spec.o_bias)
        self.eps = hf.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, self.eps)
        self.k_norm = RMSNorm(self.head_dim, self.eps) if owns_kv else None
        self.use_rope, self.rope_table = True, 1 if window else 0
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, scale=1.0,
                              sliding_window=window if window < model_config.max_model_len
                              else 0,
                              kv_cache_group=model_config.kv_cache_layout.layer_group[layer])

    def forward(self, rope: RotaryInputs, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, *kv = self.qkv_proj.forward_split(hidden)
        cos, sin = rope.table(self.rope_table == 1)
        k = v = None
        if kv:  # this layer's own keys and values (a KV-shared layer reads its source's)
            v = _value_norm(kv[-1], self.head_dim, self.eps)  # k_eq_v: the keys' projection
            q, k = apply_rotary_qk(q, kv[0], cos, sin, self.head_dim, self.q_norm, self.k_norm)
        else:
            q = self.q_norm(q.reshape(-1, self.head_dim)).reshape(num_tokens, -1)
            q = apply_rotary(q, cos, sin, self.head_dim)
        out = self.attn(q, k, v, kv_cache, meta)
        if out.shape[0] < num_tokens:  # padding rows: zeros (as LlamaAttention)
            out = F.pad(out, (0, 0, 0, num_tokens - out.shape[0]))
        return self.o_proj(out)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, model_config: ModelConfig, spec: DecoderSpec, layer: int) -> None:
        super().__init__()
        hf = model_config.hf_config
        self.self_attn = Gemma4Attention(model_config, spec, layer)
        wide = (getattr(hf, "use_double_wide_mlp", False) and spec.kv_sources is not None
                and spec.kv_sources[layer] != layer)
        self.mlp = GatedMLP(hf.hidden_size, hf.intermediate_size * (2 if wide else 1),
                            spec.mlp_bias, spec.activation)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(hf.hidden_size, hf.rms_norm_eps))
        if spec.per_layer_input_size:
            self.per_layer_input_gate = Linear(hf.hidden_size, spec.per_layer_input_size)
            self.per_layer_projection = Linear(spec.per_layer_input_size, hf.hidden_size)
            self.post_per_layer_input_norm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        set_weight_attrs(self.layer_scalar, weight_loader=default_weight_loader,
                         shard_ids=(None,))

    def forward(self, rope: RotaryInputs, hidden: torch.Tensor, per_layer: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The residual stream after this layer, [T, hidden]."""
        attn = self.self_attn(rope, self.input_layernorm(hidden), kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        hidden = hidden + self.post_feedforward_layernorm(mlp)
        if per_layer is not None:
            gate = F.gelu(self.per_layer_input_gate(hidden), approximate="tanh") * per_layer
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return hidden * self.layer_scalar.to(hidden.dtype)


class Gemma4Model(LlamaModel):
    def __init__(self, model_config: ModelConfig, spec: DecoderSpec,
                 layer_class: type[nn.Module]) -> None:
        super().__init__(model_config, spec, layer_class)
        hf = model_config.hf_config
        self.hidden_size = hf.hidden_size
        self.per_layer_input_size = size = spec.per_layer_input_size
        if size:
            layers = hf.num_hidden_layers
            self.embed_tokens_per_layer = VocabParallelEmbedding(hf.vocab_size_per_layer_input,
                                                                 layers * size)
            self.per_layer_model_projection = Linear(hf.hidden_size, layers * size)
            self.per_layer_projection_norm = RMSNorm(size, hf.rms_norm_eps)

    def per_layer_inputs(self, input_ids: torch.Tensor, embedded: torch.Tensor
                         ) -> torch.Tensor:
        """[T, layers, per-layer size]: the per-layer table's rows of the tokens (scaled by
        sqrt(size) in the activation dtype) averaged with the normalised projection of their
        scaled embeddings, as transformers' project_per_layer_inputs."""
        size, scale = self.per_layer_input_size, torch.tensor(self.per_layer_input_size ** 0.5)
        rows = self.embed_tokens_per_layer(input_ids) * scale.to(embedded.dtype)
        projected = self.per_layer_model_projection(embedded) * self.hidden_size ** -0.5
        projected = self.per_layer_projection_norm(projected.reshape(len(input_ids), -1, size))
        return (projected + rows.reshape(projected.shape)) * 2.0 ** -0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        rope, hidden = self.embed(input_ids, positions)
        per_layer = (self.per_layer_inputs(input_ids, hidden) if self.per_layer_input_size
                     else None)
        for i, layer in enumerate(self.layers):
            hidden = layer(rope, hidden, None if per_layer is None else per_layer[:, i],
                           kv_caches[i], meta)
        return self.norm(hidden)


class Gemma4ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma4DecoderLayer
    model_class = Gemma4Model
    # KV-shared layers read earlier layers' caches, and per-layer inputs come from the
    # embedding: its stages would need more than the stream.
    supports_pipeline_parallel = False

    def declare(self, hf: Any) -> DecoderSpec:
        for field in ("enable_moe_block", "use_bidirectional_attention"):
            if getattr(hf, field, None):
                raise ValueError(f"{field}={getattr(hf, field)!r} is not supported for "
                                 f"Gemma4ForCausalLM (mrv2 runs Gemma 4's dense causal text "
                                 f"model)")
        bias = bool(getattr(hf, "attention_bias", False))
        return dataclasses.replace(
            super().declare(hf), qkv_bias=bias, o_bias=bias, qk_norm=True,
            sandwich_norms=True, embedding_scale=hf.hidden_size ** 0.5, attention_scale=1.0,
            local_rope=True, logit_softcap=getattr(hf, "final_logit_softcapping", None),
            value_norm=True,
            per_layer_input_size=getattr(hf, "hidden_size_per_layer_input", 0) or 0,
            kv_sources=layer_kv_sources(hf))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        sources = self.decoder_spec.kv_sources or ()
        shared = tuple(f"model.layers.{layer}." for layer, source in enumerate(sources)
                       if source != layer)

        def used(name: str) -> bool:
            return not (name.startswith(shared)
                        and any(part in name for part in _SHARED_LAYER_UNUSED))

        return super().load_weights((name, tensor) for name, tensor in weights if used(name))
