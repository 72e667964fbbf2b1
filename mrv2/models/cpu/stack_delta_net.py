"""The fused decode stack's view of a hybrid model (models/qwen3_next.py: Qwen3.5's layers,
Gated DeltaNet or gated attention): which linear-attention layers it takes, and their
arguments (computed by stack_delta_net_numba.py).

The kernel takes every layer's attention slots as typed lists, so a linear-attention layer
(no attention of its own) fills them with its model's first attention layer's module and KV
cache view: their types, never computed for it (its flag sends it to the delta rule). Its own
weights and its state (the worker's flat float32 tensor per layer, viewed as the convolution
windows and the memories of every slot) are typed lists over the layers, with placeholders of
the same types where a layer has none.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from mrv2.models.cpu.decode_logits import float32_cpu
from mrv2.models.cpu.stack_views_numba import NO_MATRIX, projection_views
from mrv2.models.layers.numba_rows import typed_list

# A linear-attention layer's projections, in the order stack_delta_net_numba takes them.
LINEAR_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
_NO_VECTOR = np.empty(0, np.float32)
_NO_WINDOWS = np.empty((0, 0, 0), np.float32)
_NO_MEMORIES = np.empty((0, 0, 0, 0), np.float32)


def token_mixer(layer: nn.Module) -> nn.Module | None:
    """The layer's Gated DeltaNet, or None for an attention layer."""
    return getattr(layer, "linear_attn", None)


def attention_stand_in(model: nn.Module) -> int:
    """The index of the model's first attention layer, whose attention fills a
    linear-attention layer's attention slots."""
    return next(i for i, layer in enumerate(model.layers) if token_mixer(layer) is None)


def attention_of(model: nn.Module, layer: nn.Module) -> nn.Module:
    """The attention module whose fields fill `layer`'s attention slots: its own, or for a
    linear-attention layer the stand-in's (never computed for it)."""
    if token_mixer(layer) is None:
        return layer.self_attn
    return model.layers[attention_stand_in(model)].self_attn


def mixers_qualify(model: nn.Module) -> bool:
    """Every linear-attention layer as the stack computes it: Qwen3.5's separate projections
    (not Qwen3-Next's grouped ones), each on one rank, float32 CPU or packed (decode.py checks
    that each is of one kind across the layers: a typed list each); float32 CPU convolution,
    gating and norm weights of the layers' eps; one head layout. A model with none
    qualifies."""
    mixers = [m for m in map(token_mixer, model.layers) if m is not None]
    if not mixers:
        return True
    if len(mixers) == len(model.layers):
        return False  # no attention layer to stand in
    eps = model.layers[0].post_attention_layernorm.eps
    shapes = {(m.k_heads, m.v_heads, m.k_dim, m.v_dim, m.kernel_size) for m in mixers}
    projections = [getattr(m, name) for m in mixers if not m.fused_qkvz
                   for name in LINEAR_PROJECTIONS]
    return (all(not m.fused_qkvz for m in mixers) and len(shapes) == 1
            and all(p.tp_size == 1 and (p.packed is not None or float32_cpu(p.weight))
                    and p.bias is None for p in projections)
            and all(float32_cpu(t) for m in mixers
                    for t in (m.conv_weight, m.A_log, m.dt_bias, m.norm.weight))
            and all(m.norm.eps == eps for m in mixers))


def mixer_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The linear-attention tensors the kernel views that may be given new storage (its
    float32 projections, convolution, gating and norm weights)."""
    out = []
    for mixer in filter(None, map(token_mixer, model.layers)):
        out += [getattr(mixer, name).weight for name in LINEAR_PROJECTIONS
                if getattr(mixer, name).packed is None]
        out += [mixer.conv_weight, mixer.A_log, mixer.dt_bias, mixer.norm.weight]
    return out


def recurrent_args(model: nn.Module, kv_caches: list[torch.Tensor], like) -> tuple:
    """decode_stack's `recurrent`: per layer whether it is a linear-attention layer, its five
    projections' views (placeholders of `like`'s type in a model without such layers), its
    convolution weight [C, K], A_log, dt_bias, norm weight, and its state as (windows [slots,
    C, K - 1], memories [slots, Hv, Dk, Dv]); then the heads (stack_delta_net_numba's
    `dims`)."""
    mixers = [token_mixer(layer) for layer in model.layers]
    present = [m for m in mixers if m is not None]
    states = [None if m is None else m.states(kv_caches[i]) for i, m in enumerate(mixers)]

    def per_layer(part, empty):
        return typed_list(tuple(empty if m is None else part(m).detach().numpy()
                                for m in mixers))

    def state(j, empty):
        return typed_list(tuple(empty if s is None else s[j].numpy() for s in states))

    first = present[0] if present else None
    dims = [first.k_heads, first.v_heads, first.k_dim, first.v_dim] if first else [0] * 4
    return (np.array([m is not None for m in mixers], np.bool_),
            *(projection_views([None if m is None else getattr(m, name) for m in mixers],
                               like) for name in LINEAR_PROJECTIONS),
            per_layer(lambda m: m.conv_weight, NO_MATRIX),
            per_layer(lambda m: m.A_log, _NO_VECTOR), per_layer(lambda m: m.dt_bias, _NO_VECTOR),
            per_layer(lambda m: m.norm.weight, _NO_VECTOR),
            state(0, _NO_WINDOWS), state(1, _NO_MEMORIES), np.array(dims, np.int64))
