"""Mixture-of-experts feed-forward (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): a router picks each
token's top-k experts, each a gated MLP, and the block's output is their weighted sum (plus,
for Qwen2-MoE, a shared expert behind a sigmoid gate).

Routing (`route`): softmax of the router logits in float32, the top-k, renormalised to sum to
1 where the model says so (`norm_topk_prob`; Mixtral's top-k-then-softmax is the same
numbers), the weights cast to the activation dtype: transformers' order of operations.

Experts (`FusedMoE`): a layer's experts in two 3-D parameters, `gate_up_proj` [E, 2I, H] (gate
rows, then up rows) and `down_proj` [E, H, I]: transformers 5's layout, which loads as is; the
Hub's per-expert tensors (`experts.{e}.gate_proj` / `up_proj` / `down_proj`) load into their
slices. Under tensor parallelism every rank holds every expert's 1/tp of the intermediate
(gate's and up's rows, down's columns), and the partial sums are all-reduced once per block.

Compute: the token-expert pairs sorted by expert (one stable argsort), each expert with tokens
runs its two GEMMs on its rows only, scaled by their routing weights and summed into the token
rows in expert order (index_add_), as transformers sums them: only the chosen experts'
weights are read. On the CPU the experts may compute on packed weights instead (`packed`: per
expert, its gate/up and its down as a GGUF file's blocks or 16-bit weights, given by
models/cpu/quantized_weights.py at load), each through `quantized_linear`, whose plan was
chosen once per weight. CUDA tensors on float experts run the Triton twin instead
(moe_triton.py: the pairs aligned to blocks, one grouped GEMM launch per projection).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mrv2 import distributed, platform
from mrv2.models.layers.activation import GATED_ACTIVATIONS
from mrv2.models.layers.linear import (Linear, materialize, narrow, set_weight_attrs,
                                       tensor_shape, tp_rank_and_size)
from mrv2.models.layers.quantized import PackedWeight, quantized_linear
from mrv2.models.decoder_spec import DecoderSpec
from mrv2.models.layers.mlp import GatedMLP

# Per-expert checkpoint projections -> (parameter, which half of gate_up_proj; None: down).
EXPERT_PROJECTIONS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                      "down_proj": ("down_proj", None)}
_EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def expert_shard(name: str) -> tuple[str, tuple[int, int | None]] | None:
    """(parameter name, shard id) of a per-expert checkpoint tensor ("...experts.3.up_proj.
    weight" -> ("...experts.gate_up_proj", (3, 1))); None for any other name."""
    match = _EXPERT_TENSOR.match(name)
    if match is None:
        return None
    param, half = EXPERT_PROJECTIONS[match.group(3)]
    return f"{match.group(1)}.{param}", (int(match.group(2)), half)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in `dtype`, expert ids [T, k]) of each token's top-k experts."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


class FusedMoE(nn.Module):
    """A layer's routed experts (see the module docstring): forward(x, weights, ids)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 activation: str, *, tp_rank: int | None = None,
                 tp_size: int | None = None) -> None:
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"hidden_act={activation!r} is not supported for experts; "
                             f"supported: {', '.join(GATED_ACTIVATIONS)}")
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size  # the checkpoint's, every rank's whole
        self.local_intermediate = distributed.divide(intermediate_size, self.tp_size,
                                                     "moe_intermediate_size")
        self.act_and_mul = GATED_ACTIVATIONS[activation]
        local = self.local_intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, local),
                                      requires_grad=False)
        # Whole 3-D tensors (shard None), or per expert: (e, 0) gate, (e, 1) up, (e, None) down.
        set_weight_attrs(self.gate_up_proj, weight_loader=self.weight_loader,
                         shard_ids=tuple((e, h) for e in range(num_experts) for h in (0, 1)))
        set_weight_attrs(self.down_proj, weight_loader=self.weight_loader,
                         shard_ids=tuple((e, None) for e in range(num_experts)))
        # Per expert (gate/up, down) packed weights it computes on instead (`set_packed`).
        self.packed: tuple[tuple[PackedWeight, PackedWeight], ...] | None = None

    def set_packed(self, experts: list[tuple[PackedWeight, PackedWeight]]) -> None:
        """Compute on `experts` (one rank only) from now on; the float parameters are released
        (nothing reads them again)."""
        if len(experts) != self.num_experts or self.tp_size != 1:
            raise ValueError(f"packed experts: {len(experts)} for {self.num_experts} experts "
                             f"on tp {self.tp_size} (one rank only)")
        self.packed = tuple(experts)
        for name in ("gate_up_proj", "down_proj"):
            setattr(self, name, nn.Parameter(torch.empty(0), requires_grad=False))

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """This rank's part of a whole 3-D tensor (shard None) or of one expert's projection
        (shard (expert, half))."""
        local, rank = self.local_intermediate, self.tp_rank
        is_down = param is self.down_proj
        axis = 2 if is_down else 1  # the intermediate dim (of the 3-D parameter)
        if shard_id is None:
            full = ((self.num_experts, self.hidden_size, self.intermediate_size) if is_down else
                    (self.num_experts, 2 * self.intermediate_size, self.hidden_size))
            if tensor_shape(loaded) != full:
                raise ValueError(f"experts: checkpoint tensor has shape "
                                 f"{tensor_shape(loaded)}, expected {full}")
            with torch.no_grad():
                if is_down:
                    param.copy_(materialize(narrow(loaded, axis, rank * local, local)))
                    return
                for half in (0, 1):  # gate rows, then up rows
                    start = half * self.intermediate_size + rank * local
                    param[:, half * local:(half + 1) * local].copy_(
                        materialize(narrow(loaded, axis, start, local)))
            return
        expert, half = shard_id
        full = ((self.hidden_size, self.intermediate_size) if is_down
                else (self.intermediate_size, self.hidden_size))
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert}: the layer has {self.num_experts} experts")
        if tensor_shape(loaded) != full:
            raise ValueError(f"expert {expert}: checkpoint tensor has shape "
                             f"{tensor_shape(loaded)}, expected {full}")
        rows = narrow(loaded, axis - 1, rank * local, local)
        with torch.no_grad():
            if is_down:
                param[expert].copy_(materialize(rows))
            else:
                param[expert, half * local:(half + 1) * local].copy_(materialize(rows))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        """x [T, H], routing weights and expert ids [T, k] -> [T, H] (all-reduced)."""
        if self.packed is None and platform.kernel_impl(
                x.device, portable_cpu_impl=True) == platform.TRITON:
            from mrv2.models.layers import moe_triton  # Triton is imported on first use only

            out = moe_triton.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids,
                                       self.act_and_mul)
            return distributed.tp_all_reduce(out) if self.tp_size > 1 else out
        top_k = ids.shape[1]
        order = torch.argsort(ids.reshape(-1), stable=True)
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts).tolist()
        tokens = order // top_k
        pair_weights = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start:start + count]
            if self.packed is not None:
                gate_up, down = self.packed[expert]
                hidden = self.act_and_mul(quantized_linear(x[rows], gate_up))
                y = quantized_linear(hidden, down)
            else:
                hidden = self.act_and_mul(F.linear(x[rows], self.gate_up_proj[expert]))
                y = F.linear(hidden, self.down_proj[expert])
            out.index_add_(0, rows, y * pair_weights[start:start + count, None])
            start += count
        return distributed.tp_all_reduce(out) if self.tp_size > 1 else out

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, "
                f"intermediate={self.local_intermediate} (of {self.intermediate_size})")


class SparseMoE(nn.Module):
    """A MoE feed-forward block: `gate` (the router, replicated), `experts`, and optionally
    Qwen2-MoE's `shared_expert` (a gated MLP every token goes through) scaled by
    sigmoid(`shared_expert_gate`(x))."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 intermediate_size: int, activation: str, renormalize: bool,
                 shared_intermediate_size: int = 0) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..{num_experts}")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Linear(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, activation)
        self.shared_expert = (GatedMLP(hidden_size, shared_intermediate_size, False, activation)
                              if shared_intermediate_size else None)
        self.shared_expert_gate = Linear(hidden_size, 1) if shared_intermediate_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, x.dtype)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out.reshape(shape)


def feed_forward(hidden_size: int, intermediate_size: int, spec: DecoderSpec,
                 layer: int) -> nn.Module:
    """Layer `layer`'s feed-forward as the spec declares it: routed experts (`spec.moe`) or the
    dense gated MLP."""
    if not spec.is_sparse(layer):
        return GatedMLP(hidden_size, intermediate_size, spec.mlp_bias, spec.activation)
    moe = spec.moe
    return SparseMoE(hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size,
                     spec.activation, moe.renormalize, moe.shared_intermediate_size)
