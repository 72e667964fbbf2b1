"""The fused decode stack's view of a mixture-of-experts model (layers/moe.py's SparseMoE,
computed in the stack by moe_numba.py): which MoE layers it takes, and their arguments.

A layer's feed-forward in the stack is a dense slot (the gated MLP: a dense layer's own, a MoE
layer's shared expert, or none) and a routed slot (router and experts; none in a dense
layer). The kernel takes each slot as typed lists over the layers, so a layer without one
holds a placeholder of the same numba type (no rows; `stack_views_numba.no_rows`).
"""

from __future__ import annotations

import dataclasses

import numba
import numpy as np
import torch
from torch import nn

from numba import typed

from mrv2.models.cpu.decode_logits import float32_cpu
from mrv2.models.cpu.moe_numba import (EXPERT_ACTIVATION_ARGUMENTS, EXPERT_ACTIVATIONS,
                                          activation_args, expert_weights)
from mrv2.models.cpu.stack_views_numba import NO_MATRIX, no_rows, weight_view
from mrv2.models.decoder_spec import DecoderSpec, MoESpec
from mrv2.models.layers.moe import FusedMoE, SparseMoE
from mrv2.models.layers.numba_rows import typed_list



def sparse_block(layer: nn.Module) -> SparseMoE | None:
    """The layer's routed feed-forward, or None for a dense layer."""
    return layer.mlp if isinstance(layer.mlp, SparseMoE) else None


def dense_mlp(layer: nn.Module) -> nn.Module | None:
    """The gated MLP the stack runs in the layer's dense slot: a dense layer's own, a MoE
    layer's shared expert (Qwen2-MoE), or None."""
    block = sparse_block(layer)
    return layer.mlp if block is None else block.shared_expert


def layer_projection(layer: nn.Module, name: str) -> nn.Module | None:
    """One of onednn_decode.PROJECTIONS of `layer` ("self_attn.qkv_proj", ..., "mlp.down_proj"),
    the MLP's taken from the dense slot (None: the layer has none; a linear-attention layer
    has no attention projections)."""
    if name.startswith("self_attn."):  # none in a linear-attention layer (Qwen3.5)
        attn = getattr(layer, "self_attn", None)
        return None if attn is None else getattr(attn, name.removeprefix("self_attn."))
    if not name.startswith("mlp."):
        return layer.get_submodule(name)
    mlp = dense_mlp(layer)
    return None if mlp is None else getattr(mlp, name.removeprefix("mlp."))


def _replicated_float32(linear: nn.Module | None) -> bool:
    """A router or shared-expert gate the kernel reads: float32 CPU, its bias too."""
    return linear is None or (linear.packed is None and float32_cpu(linear.weight)
                              and (linear.bias is None or float32_cpu(linear.bias)))


def _experts_qualify(experts: FusedMoE) -> bool:
    biases = [b for b in (experts.gate_up_proj_bias, experts.down_proj_bias) if b is not None]
    return experts.tp_size == 1 and all(float32_cpu(b) for b in biases) and (
        experts.packed is not None or (float32_cpu(experts.gate_up_proj)
                                       and float32_cpu(experts.down_proj)))


# The MoESpec fields moe_numba computes (any value; the activation checked apart); every other
# field must hold its default. (`checkpoint_layout` says how weights load, not what computes.)
_COMPUTED_FIELDS = frozenset({"num_experts", "top_k", "intermediate_size", "renormalize",
                              "sparse_layers", "shared_intermediate_size", "router_bias",
                              "expert_bias", "activation", "activation_kwargs",
                              "checkpoint_layout"})


def moe_supported(moe: MoESpec | None, activation: str = "silu") -> bool:
    """Whether the stack computes the routing and experts `moe` declares (None, no experts:
    True) in a model of `activation`: softmax-then-top-k routing, optionally renormalised,
    with a router bias or not, experts with biases or not, SiLU-, GeLU(tanh)- or
    clamped-SwiGLU-gated, a shared expert behind a sigmoid gate; a field it does not know
    about set to anything but its default refuses the model (it runs on the module path)."""
    if moe is None:
        return True
    return ((moe.activation or activation) in EXPERT_ACTIVATIONS
            and {name for name, _ in moe.activation_kwargs} <= set(EXPERT_ACTIVATION_ARGUMENTS)
            and all(getattr(moe, f.name) == f.default for f in dataclasses.fields(moe)
                    if f.name not in _COMPUTED_FIELDS))


def moe_qualifies(model: nn.Module) -> bool:
    """Whether the stack computes every MoE layer of `model` (none: True): float32 bias-free
    routers (and shared-expert gates), the experts on one rank, packed or float32, whose views
    share one numba type."""
    blocks = [block for block in map(sparse_block, model.layers) if block is not None]
    if not blocks:
        return True
    return (all(_replicated_float32(b.gate) and _replicated_float32(b.shared_expert_gate)
                and _experts_qualify(b.experts) for b in blocks)
            and _uniform_expert_views(blocks) is not None)


def moe_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The tensors the stack's MoE views read that may be given new storage: the routers, the
    shared-expert gates and float32 experts' parameters."""
    out = []
    for block in filter(None, map(sparse_block, model.layers)):
        experts = block.experts
        out += [block.gate.weight, *_present(block.gate.bias, experts.gate_up_proj_bias,
                                             experts.down_proj_bias)]
        if block.shared_expert_gate is not None:
            out.append(block.shared_expert_gate.weight)
        if experts.packed is None:
            out += [experts.gate_up_proj, experts.down_proj]
    return out


def _present(*tensors: torch.Tensor | None) -> list[torch.Tensor]:
    return [t for t in tensors if t is not None]


def _per_layer(matrices) -> typed.List:
    return typed_list(tuple(matrices))


def _matrix(tensor: torch.Tensor | None, rows: int | None = None) -> np.ndarray:
    """A float32 tensor as the kernel reads it (`rows`: reshaped), [0, 0] for none."""
    if tensor is None:
        return NO_MATRIX
    view = tensor.detach().numpy()
    return view if rows is None else view.reshape(rows, -1)


def _expert_views(blocks: list[SparseMoE], float32_tables: bool = False) -> list[tuple]:
    return [(weight_view(gate_up, float32_tables), weight_view(down, float32_tables))
            for block in blocks for gate_up, down in expert_weights(block.experts)]


def _uniform_expert_views(blocks: list[SparseMoE]) -> list[tuple] | None:
    """Every expert's (gate/up, down) views, the gate/ups of one numba type and the downs of
    one (as projection_views: where table dtypes differ, all with float32 tables); None where
    they still differ (16-bit beside blocks)."""
    for float32_tables in (False, True):
        views = _expert_views(blocks, float32_tables)
        if all(len({numba.typeof(pair[j]) for pair in views}) <= 1 for j in (0, 1)):
            return views
    return None


def moe_args(model: nn.Module, spec: DecoderSpec, like) -> tuple:
    """decode_stack's `moe`: per layer the router [experts, hidden], its bias [1, experts] and
    the shared-expert gate [1, hidden] (float32; [0, 0]: none), each expert's gate/up and down
    views, their biases [experts, 2 * width] and [experts, hidden] (a dense layer:
    one placeholder each, of `like`'s type in a dense model: the view of another projection,
    so that a dense model and a MoE one of one weight kind share one compiled stack), then
    top-k, whether renormalised, the experts' width and activation (moe_numba's code, alpha,
    limit)."""
    layers = list(model.layers)
    blocks = [sparse_block(layer) for layer in layers]
    sparse = [b for b in blocks if b is not None]
    views = _uniform_expert_views(sparse) if sparse else []
    placeholder = (no_rows(views[0][0]), no_rows(views[0][1])) if views else (no_rows(like),) * 2
    per_layer, start = [], 0
    for block in blocks:
        count = 0 if block is None else block.experts.num_experts
        per_layer.append(views[start:start + count] or [placeholder])
        start += count
    moe = spec.moe
    activation = activation_args((moe and moe.activation) or spec.activation,
                                 dict(moe.activation_kwargs if moe else ()))
    experts = [None if b is None else b.experts for b in blocks]

    return (_per_layer(NO_MATRIX if b is None else _matrix(b.gate.weight)
                               for b in blocks),
            _per_layer(NO_MATRIX if b is None else _matrix(b.gate.bias, 1)
                               for b in blocks),
            _per_layer(NO_MATRIX if b is None else _matrix(
                None if b.shared_expert_gate is None else b.shared_expert_gate.weight)
                for b in blocks),
            *(typed_list(tuple(typed_list(tuple(pair[j] for pair in pairs))
                               for pairs in per_layer)) for j in (0, 1)),
            _per_layer(NO_MATRIX if e is None else _matrix(e.gate_up_proj_bias)
                               for e in experts),
            _per_layer(NO_MATRIX if e is None else _matrix(e.down_proj_bias)
                               for e in experts),
            np.int64(moe.top_k if moe else 1), bool(moe and moe.renormalize),
            np.int64(moe.intermediate_size if moe else 0), activation)
