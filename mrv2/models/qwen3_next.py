"""Hybrid decoders with recurrent layers: Qwen3-Next and Qwen3.5 (dense and MoE).

Three of every four layers mix tokens with a gated delta rule (Gated DeltaNet: a short causal
convolution over q, k and v, then a decaying associative memory written by the delta rule; the
kernels are models/layers/gated_delta_rule.py) and keep a fixed-size state per request; the
others are full attention whose output is gated per head by sigmoid of a second half of the q
projection, with per-head q/k norms and partial rotary. Every norm multiplies by 1 + w
(`norm_unit_offset`) except the delta rule's output norm, gated by SiLU of its z projection.

The state (`kv_caches[i]` of a linear-attention layer) is one flat float32 tensor per layer
holding every slot's convolution window, then every slot's memory (the worker sizes it from
core/kv_cache_layout.recurrent_state_shapes); a row's slot is `meta.slots`, and a row whose
request starts from scratch (no computed tokens before this step) reads zeros, so a reused slot
needs no reset. On the CPU, their decode steps run on the fused decode stack
(models/cpu/stack_delta_net*.py: the same kernels on the same state). Prefix caching is off
for these models (a cached prefix has KV blocks but no state: mrv2/engine/arg_utils.py);
preemption recomputes, which restarts the state.

Projections: Qwen3-Next fuses q, k, v and z into `in_proj_qkvz` (and b, a into `in_proj_ba`),
grouped per key head; Qwen3.5 has `in_proj_qkv` (q, k, v of every head, in that order),
`in_proj_z`, `in_proj_b`, `in_proj_a`. Under tensor parallelism each rank holds its key heads
and the value heads they serve: the grouped projections split contiguously, the q/k/v ones
and the convolution per segment, A_log and dt_bias per value head, out_proj by rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from mrv2 import distributed
from mrv2.attention import Attention, AttentionMetadata
from mrv2.config import ModelConfig
from mrv2.core.kv_cache_layout import recurrent_layers, recurrent_state_shapes
from mrv2.models.decoder_spec import DecoderSpec
from mrv2.models.layers import gated_delta_rule as gdr
from mrv2.models.layers.linear import (ColumnParallelLinear, MergedLinear, QKVLinear,
                                       RowParallelLinear, default_weight_loader, materialize,
                                       narrow, set_weight_attrs)
from mrv2.models.layers.moe import feed_forward
from mrv2.models.layers.norm import RMSNorm, pre_norm
from mrv2.models.layers.rotary import RotaryInputs, apply_rotary_qk
from mrv2.models.llama import LlamaForCausalLM
from mrv2.models.moe import qwen_moe


class GatedAttention(nn.Module):
    """Full attention with a per-head output gate: q_proj gives each head's query and gate
    side by side ([T, H, 2 * D]); out = o_proj(attention * sigmoid(gate))."""

    use_rope = True  # every layer rotates, by the model's one table (the fused stack reads it)
    rope_table = None

    def __init__(self, model_config: ModelConfig, spec: DecoderSpec, layer: int) -> None:
        super().__init__()
        hf = model_config.hf_config
        self.head_dim = model_config.head_dim
        # Twice the heads in the q shard: each head's query then its gate (kept together when
        # the heads split over ranks).
        self.qkv_proj = QKVLinear(hf.hidden_size, self.head_dim,
                                  2 * model_config.num_attention_heads, model_config.num_kv_heads,
                                  bias=spec.qkv_bias)
        self.num_heads = self.qkv_proj.num_heads // 2
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(model_config.num_attention_heads * self.head_dim,
                                        hf.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(self.head_dim, hf.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, hf.rms_norm_eps, unit_offset=True)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads,
                              scale=self.head_dim ** -0.5,
                              kv_cache_group=model_config.kv_cache_layout.layer_group[layer])

    def forward(self, rope: RotaryInputs, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q_gate, k, v = self.qkv_proj.forward_split(hidden)
        q_gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim)
        q = q_gate[..., :self.head_dim].reshape(num_tokens, -1)
        gate = q_gate[..., self.head_dim:].reshape(num_tokens, -1)
        q, k = apply_rotary_qk(q, k, rope.cos, rope.sin, self.head_dim, self.q_norm,
                               self.k_norm)
        out = self.attn(q, k, v, kv_cache, meta)
        if out.shape[0] < num_tokens:  # padding rows: zeros (LlamaAttention's rule)
            out = F.pad(out, (0, 0, 0, num_tokens - out.shape[0]))
        return self.o_proj(out * torch.sigmoid(gate))


class GatedRMSNorm(nn.Module):
    """The delta rule's output norm: weight * norm(x), times SiLU(z) (float32 gate), per value
    head; transformers' Qwen3NextRMSNormGated order and rounding."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(width), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=default_weight_loader, shard_ids=(None,))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer: projections, the causal convolution and the gated delta rule
    over the rows' per-slot states, the gated norm and out_proj."""

    def __init__(self, model_config: ModelConfig, layer: int, fused_qkvz: bool) -> None:
        super().__init__()
        hf = model_config.hf_config
        tp = distributed.get_tp_size()
        self.tp_rank = distributed.get_tp_rank()
        self.k_heads = distributed.divide(hf.linear_num_key_heads, tp, "linear_num_key_heads")
        self.v_heads = distributed.divide(hf.linear_num_value_heads, tp,
                                          "linear_num_value_heads")
        self.k_dim, self.v_dim = hf.linear_key_head_dim, hf.linear_value_head_dim
        self.group = self.v_heads // self.k_heads  # value heads per key head
        key, value = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        (self.conv_dim, width), self.memory_shape = recurrent_state_shapes(hf, tp)
        self.kernel_size = width + 1
        total_key = hf.linear_num_key_heads * self.k_dim
        total_value = hf.linear_num_value_heads * self.v_dim
        self.fused_qkvz = fused_qkvz
        if fused_qkvz:  # per key head: q, k, then its value heads' v and z
            self.in_proj_qkvz = ColumnParallelLinear(hf.hidden_size,
                                                     2 * total_key + 2 * total_value)
            self.in_proj_ba = ColumnParallelLinear(hf.hidden_size,
                                                   2 * hf.linear_num_value_heads)
        else:
            self.in_proj_qkv = MergedLinear(hf.hidden_size, [total_key, total_key, total_value])
            self.in_proj_z = ColumnParallelLinear(hf.hidden_size, total_value)
            self.in_proj_b = ColumnParallelLinear(hf.hidden_size, hf.linear_num_value_heads)
            self.in_proj_a = ColumnParallelLinear(hf.hidden_size, hf.linear_num_value_heads)
        self.split = (key, key, value)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel_size),
                                        requires_grad=False)
        set_weight_attrs(self.conv_weight, weight_loader=self._conv_loader, shard_ids=(None,))
        self.A_log = nn.Parameter(torch.empty(self.v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.v_heads), requires_grad=False)
        for param in (self.A_log, self.dt_bias):
            set_weight_attrs(param, weight_loader=self._head_loader, shard_ids=(None,))
        self.norm = GatedRMSNorm(self.v_dim, hf.rms_norm_eps)
        self.out_proj = RowParallelLinear(total_value, hf.hidden_size)

    def _conv_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """The checkpoint's [channels, 1, kernel] (q, k, v of every head): this rank's part of
        each of the three."""
        full = materialize(loaded).reshape(-1, self.kernel_size)
        tp = distributed.get_tp_size()
        parts, start = [], 0
        for size in self.split:
            parts.append(full[start + self.tp_rank * size:][:size])
            start += size * tp
        default_weight_loader(param, torch.cat(parts), shard_id)

    def _head_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        default_weight_loader(param, narrow(loaded, 0, self.tp_rank * self.v_heads,
                                            self.v_heads), shard_id)

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, k and v side by side [T, conv channels], z [T, Hv, Dv], b, a [T, Hv])."""
        t = hidden.shape[0]
        if not self.fused_qkvz:
            return (self.in_proj_qkv(hidden), self.in_proj_z(hidden).view(t, -1, self.v_dim),
                    self.in_proj_b(hidden), self.in_proj_a(hidden))
        group_v = self.group * self.v_dim
        qkvz = self.in_proj_qkvz(hidden).view(t, self.k_heads, -1)
        q, k, v, z = qkvz.split([self.k_dim, self.k_dim, group_v, group_v], dim=-1)
        b, a = self.in_proj_ba(hidden).view(t, self.k_heads, -1).split(self.group, dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, -1, self.v_dim), b.reshape(t, -1), a.reshape(t, -1)

    def states(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat state tensor as (conv windows [slots, C, K - 1], memories [slots, Hv, Dk,
        Dv]), each contiguous."""
        conv = self.conv_dim * (self.kernel_size - 1)
        slots = cache.numel() // (conv + self.v_heads * self.k_dim * self.v_dim)
        return (cache[:slots * conv].view(slots, self.conv_dim, self.kernel_size - 1),
                cache[slots * conv:].view(slots, *self.memory_shape))

    def forward(self, hidden: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor:
        num_tokens, n = hidden.shape[0], meta.num_reqs
        actual = meta.num_actual_tokens
        mixed, z, b, a = self._project(hidden[:actual])
        conv_state, memory = self.states(cache)
        starts, starts_np = meta.query_start_loc[:n + 1], meta.query_start_loc_np[:n + 1]
        continues = meta.rows_with_context
        slots = meta.slots[:n]
        mixed = gdr.causal_conv1d(mixed, self.conv_weight, None, conv_state, starts, slots,
                                  continues, query_start_loc_np=starts_np)
        q, k, v = mixed.split(self.split, dim=-1)
        g, beta = gdr.gdn_gating(a, b, self.A_log, self.dt_bias)
        out = gdr.gated_delta_rule(q.reshape(actual, self.k_heads, self.k_dim),
                                   k.reshape(actual, self.k_heads, self.k_dim),
                                   v.reshape(actual, self.v_heads, self.v_dim), g, beta, memory,
                                   starts, slots, continues, query_start_loc_np=starts_np)
        out = self.norm(out, z).reshape(actual, -1)
        if actual < num_tokens:  # padding rows: zeros
            out = F.pad(out, (0, 0, 0, num_tokens - actual))
        return self.out_proj(out)


class Qwen3NextDecoderLayer(nn.Module):
    fused_qkvz = True  # Qwen3-Next's grouped projections; Qwen3.5's are separate

    def __init__(self, model_config: ModelConfig, spec: DecoderSpec, layer: int) -> None:
        super().__init__()
        hf = model_config.hf_config
        # One token mixer per layer, under its checkpoint name.
        self.is_linear_attention = spec.is_linear_attention(layer)
        if self.is_linear_attention:
            self.linear_attn = GatedDeltaNet(model_config, layer, self.fused_qkvz)
        else:
            self.self_attn = GatedAttention(model_config, spec, layer)
        self.mlp = feed_forward(hf.hidden_size, getattr(hf, "intermediate_size", 0), spec,
                                layer)
        self.input_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps,
                                                unit_offset=True)

    def forward(self, rope: RotaryInputs, hidden: torch.Tensor, residual: torch.Tensor | None,
                cache: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, residual stream before adding it)."""
        hidden, residual = pre_norm(self.input_layernorm, hidden, residual)
        if self.is_linear_attention:
            hidden = self.linear_attn(hidden, cache, meta)
        else:
            hidden = self.self_attn(rope, hidden, cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3_5DecoderLayer(Qwen3NextDecoderLayer):
    fused_qkvz = False


class Qwen3NextForCausalLM(LlamaForCausalLM):
    layer_class: type[nn.Module] = Qwen3NextDecoderLayer
    qk_norm = True
    supports_pipeline_parallel = False  # the states are not split by stage yet
    has_linear_attention = True

    def declare(self, hf: Any) -> DecoderSpec:
        moe = qwen_moe(hf, int(getattr(hf, "shared_expert_intermediate_size", 0) or 0)) \
            if getattr(hf, "num_experts", 0) else None
        return dataclasses.replace(super().declare(hf), norm_unit_offset=True, moe=moe,
                                   attention_output_gate=True,
                                   linear_attention=recurrent_layers(hf))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # The convolution is the layer's `conv_weight`; the multi-token-prediction head of
        # released checkpoints (`mtp.*`) serves speculative decoding, which these models
        # refuse: not loaded.
        return super().load_weights((name.replace(".conv1d.weight", ".conv_weight"), tensor)
                                    for name, tensor in weights if not name.startswith("mtp."))


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    layer_class = Qwen3_5DecoderLayer

    def declare(self, hf: Any) -> DecoderSpec:  # dense: its config has no expert fields
        return dataclasses.replace(super().declare(hf), moe=None)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    def declare(self, hf: Any) -> DecoderSpec:
        # Every layer routed; the router always renormalises its top k.
        moe = dataclasses.replace(qwen_moe(hf, hf.shared_expert_intermediate_size),
                                  renormalize=True)
        return dataclasses.replace(super().declare(hf), moe=moe)
