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

# A linear-attention layer's projections, in the order stack_delta_net_numba takes them:
# Qwen3.5's separate ones, or Qwen3-Next's grouped ones (q, k, v and z in one, b and a in
# another, per key head; none in the slots of z and a).
LINEAR_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
GROUPED_PROJECTIONS = ("in_proj_qkvz", None, "in_proj_ba", None, "out_proj")
_NO_VECTOR = np.empty(0, np.float32)
_NO_WINDOWS = np.empty((0, 0, 0), np.float32)
_NO_MEMORIES = np.empty((0, 0, 0, 0), np.float32)


def token_mixer(layer: nn.Module) -> nn.Module | None:
    """The layer's Gated DeltaNet, or None for an attention layer."""
    return getattr(layer, "linear_attn", None)


def mixer_projections(mixer: nn.Module) -> tuple[nn.Module | None, ...]:
    """The layer's projections in the kernel's order (LINEAR_PROJECTIONS or, for Qwen3-Next's
    grouped layout, GROUPED_PROJECTIONS)."""
    names = GROUPED_PROJECTIONS if mixer.fused_qkvz else LINEAR_PROJECTIONS
    return tuple(None if name is None else getattr(mixer, name) for name in names)


def attention_sources(model: nn.Module) -> list[int]:
    """Per layer, the layer whose attention module and KV cache fill its attention slots: its
    own, or for a linear-attention layer the model's first attention layer (never computed
    for it)."""
    layers = list(model.layers)
    stand_in = next(i for i, layer in enumerate(layers) if token_mixer(layer) is None)
    return [stand_in if token_mixer(layer) is not None else i
            for i, layer in enumerate(layers)]


def mixers_qualify(model: nn.Module) -> bool:
    """Every linear-attention layer as the stack computes it: its projections (Qwen3.5's or
    Qwen3-Next's), each on one rank, float32 CPU or packed (decode.py checks that each is of
    one kind across the layers: a typed list each); float32 CPU convolution, gating and norm
    weights of the layers' eps; one head layout. A model with none qualifies."""
    mixers = [m for m in map(token_mixer, model.layers) if m is not None]
    if not mixers:
        return True
    if len(mixers) == len(model.layers):
        return False  # no attention layer to stand in
    eps = model.layers[0].post_attention_layernorm.eps
    shapes = {(m.k_heads, m.v_heads, m.k_dim, m.v_dim, m.kernel_size, m.fused_qkvz)
              for m in mixers}
    projections = [p for m in mixers for p in mixer_projections(m) if p is not None]
    return (len(shapes) == 1
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
        out += [p.weight for p in mixer_projections(mixer)
                if p is not None and p.packed is None]
        out += [mixer.conv_weight, mixer.A_log, mixer.dt_bias, mixer.norm.weight]
    return out


def recurrent_args(model: nn.Module, kv_caches: list[torch.Tensor], like) -> tuple | None:
    """decode_stack's `recurrent` (None for a model without linear-attention layers: the
    kernel's branch for them is then compiled out): per layer whether it is a linear-attention
    layer, its five projections' views (placeholders of `like`'s type), its
    convolution weight [C, K], A_log, dt_bias, norm weight, and its state as (windows [slots,
    C, K - 1], memories [slots, Hv, Dk, Dv]); then the heads and whether the projections are
    grouped (stack_delta_net_numba's `dims`)."""
    mixers = [token_mixer(layer) for layer in model.layers]
    present = [m for m in mixers if m is not None]
    if not present:
        return None
    states = [None if m is None else m.states(kv_caches[i]) for i, m in enumerate(mixers)]

    def per_layer(part, empty):
        return typed_list(tuple(empty if m is None else part(m).detach().numpy()
                                for m in mixers))

    def state(j, empty):
        return typed_list(tuple(empty if s is None else s[j].numpy() for s in states))

    first = present[0]
    dims = [first.k_heads, first.v_heads, first.k_dim, first.v_dim, int(first.fused_qkvz)]
    slots = len(LINEAR_PROJECTIONS)
    projections = [(None,) * slots if m is None else mixer_projections(m) for m in mixers]
    return (np.array([m is not None for m in mixers], np.bool_),
            *(projection_views([p[j] for p in projections], like) for j in range(slots)),
            per_layer(lambda m: m.conv_weight, NO_MATRIX),
            per_layer(lambda m: m.A_log, _NO_VECTOR), per_layer(lambda m: m.dt_bias, _NO_VECTOR),
            per_layer(lambda m: m.norm.weight, _NO_VECTOR),
            state(0, _NO_WINDOWS), state(1, _NO_MEMORIES), np.array(dims, np.int64))
