"""Mixture-of-experts feed-forward (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gpt-oss): a router
picks each token's top-k experts, each a gated MLP, and the block's output is their weighted
sum (plus, for Qwen2-MoE, a shared expert behind a sigmoid gate).

Routing (`route`): softmax of the router logits in float32, the top-k, renormalised to sum to
1 where the model says so (`norm_topk_prob`; Mixtral's and gpt-oss's top-k-then-softmax is
the same numbers), the weights cast to the activation dtype: transformers' order of
operations. gpt-oss's router has a bias.

Experts (`FusedMoE`): a layer's experts in two 3-D parameters, `gate_up_proj` [E, 2I, H] (gate
rows, then up rows) and `down_proj` [E, H, I]: transformers 5's layout, which loads as is; the
Hub's per-expert tensors (`experts.{e}.gate_proj` / `up_proj` / `down_proj`) load into their
slices. gpt-oss's checkpoints hold them transposed, [E, H, 2I] with gate and up columns
alternating and [E, I, H] (`checkpoint_layout` "interleaved_transposed"): converted to the
stacked layout at load, as are its expert biases (`gate_up_proj_bias` [E, 2I], `down_proj_bias`
[E, H]). Under tensor parallelism every rank holds every expert's 1/tp of the intermediate
(gate's and up's rows and biases, down's columns), and the partial sums are all-reduced once
per block; down's bias is added by rank 0 alone, so the sum holds it once.

Expert parallelism (vLLM's `enable_expert_parallel`; distributed.get_expert_parallel, set once
per worker from ParallelConfig): the same tp ranks hold whole experts instead, rank r the
contiguous run `expert_range` gives (vLLM's linear placement: E // tp each, the first E % tp
ranks one more), with their biases. Routing is replicated (every rank computes the same
top-k for every token); each rank computes the pairs routed to its experts only (global ids
made local, the other pairs dropped), and the block's output is all-reduced as under tensor
parallelism. No all-to-all: every rank already holds every token, and the one all-reduce a
block is the traffic tensor parallelism has. The loader slices a rank's experts from whole
3-D tensors and skips other ranks' per-expert tensors. At tp 1 it is a no-op. Packed experts
(below) are whole experts: one rank's, or under expert parallelism each rank's own (a GGUF's
blocks or 16-bit weights); tensor parallelism's intermediate slices compute on float weights.

Compute: the token-expert pairs sorted by expert (one stable argsort), each expert with tokens
runs its two GEMMs on its rows only, scaled by their routing weights and summed into the token
rows in expert order (an indexed add), as transformers sums them: only the chosen experts'
weights are read. On the CPU the experts may compute on packed weights instead (`packed`: per
expert, its gate/up and its down as a GGUF file's blocks or 16-bit weights, given by
models/cpu/quantized_weights.py at load), each through `quantized_linear`, whose plan was
chosen once per weight. On the CPU, a step of up to 32 float32 rows (and every decode step of
the fused stack) runs the numba twin instead (models/cpu/moe_numba.py: one call for all
experts, on the same views as the stack's). CUDA tensors on float experts run the Triton
twin instead (moe_triton.py: the pairs aligned to blocks, one grouped GEMM launch per
projection).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mrv2 import distributed, platform
from mrv2.models.layers.activation import GATED_ACTIVATIONS
from mrv2.models.layers.linear import (Linear, default_weight_loader, materialize, narrow,
                                       set_weight_attrs, tensor_shape, tp_rank_and_size)
from mrv2.models.layers.quantized import PackedWeight, quantized_linear
from mrv2.models.decoder_spec import DecoderSpec
from mrv2.models.layers.mlp import GatedMLP

# Per-expert checkpoint projections -> (parameter, which half of gate_up_proj; None: down).
EXPERT_PROJECTIONS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                      "down_proj": ("down_proj", None)}
# How a checkpoint holds a layer's 3-D expert tensors: transformers 5's (gate rows then up rows,
# out x in) or gpt-oss's (in x out, gate and up columns alternating).
EXPERT_LAYOUTS = ("stacked", "interleaved_transposed")
_EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def expert_shard(name: str) -> tuple[str, tuple[int, int | None]] | None:
    """(parameter name, shard id) of a per-expert checkpoint tensor ("...experts.3.up_proj.
    weight" -> ("...experts.gate_up_proj", (3, 1))); None for any other name."""
    match = _EXPERT_TENSOR.match(name)
    if match is None:
        return None
    param, half = EXPERT_PROJECTIONS[match.group(3)]
    return f"{match.group(1)}.{param}", (int(match.group(2)), half)


def _as_stacked(tensor: torch.Tensor, is_down: bool) -> torch.Tensor:
    """A gpt-oss expert tensor in the stacked layout: gate_up [E, H, 2I] -> [E, 2I, H] (gate
    rows, then up rows), down [E, I, H] -> [E, H, I], gate_up's bias [E, 2I] de-interleaved."""
    if tensor.dim() == 3:
        tensor = tensor.transpose(1, 2)
    if is_down:
        return tensor
    return torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)


def expert_range(num_experts: int, rank: int, size: int) -> tuple[int, int]:
    """(first expert, count) of `rank` under expert parallelism over `size` ranks: vLLM's
    linear placement (determine_expert_map), contiguous runs, the remainder going one each to
    the first ranks (a rank may get none when there are fewer experts than ranks)."""
    base, extra = divmod(num_experts, size)
    return rank * base + min(rank, extra), base + (rank < extra)


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
                 activation: str, *, bias: bool = False,
                 activation_kwargs: tuple[tuple[str, float], ...] = (),
                 checkpoint_layout: str = "stacked", tp_rank: int | None = None,
                 tp_size: int | None = None, expert_parallel: bool | None = None) -> None:
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"hidden_act={activation!r} is not supported for experts; "
                             f"supported: {', '.join(GATED_ACTIVATIONS)}")
        if checkpoint_layout not in EXPERT_LAYOUTS:
            raise ValueError(f"expert checkpoint layout {checkpoint_layout!r}: expected one "
                             f"of {', '.join(EXPERT_LAYOUTS)}")
        self.checkpoint_layout = checkpoint_layout
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        if expert_parallel is None:  # the worker's setting, as the rank and size
            expert_parallel = distributed.get_expert_parallel()
        self.expert_parallel = expert_parallel and self.tp_size > 1
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size  # the checkpoint's, every rank's whole
        # This rank's experts: global ids [expert_start, expert_start + num_local_experts).
        self.expert_start, self.num_local_experts = (
            expert_range(num_experts, self.tp_rank, self.tp_size) if self.expert_parallel
            else (0, num_experts))
        self.local_intermediate = intermediate_size if self.expert_parallel else (
            distributed.divide(intermediate_size, self.tp_size, "moe_intermediate_size"))
        act, kwargs = GATED_ACTIVATIONS[activation], dict(activation_kwargs)
        self.act_and_mul = (lambda gate_up: act(gate_up, **kwargs)) if kwargs else act
        self.activation, self.activation_kwargs = activation, kwargs
        self._numba = None  # moe_numba.NumbaExperts, built on first use (`_numba_experts`)
        local, count = self.local_intermediate, self.num_local_experts
        self.gate_up_proj = nn.Parameter(torch.empty(count, 2 * local, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(count, hidden_size, local),
                                      requires_grad=False)
        # Whole 3-D tensors (shard None), or per expert: (e, 0) gate, (e, 1) up, (e, None) down
        # (every global expert: another rank's loads as skipped).
        set_weight_attrs(self.gate_up_proj, weight_loader=self.weight_loader,
                         shard_ids=tuple((e, h) for e in range(num_experts) for h in (0, 1)))
        set_weight_attrs(self.down_proj, weight_loader=self.weight_loader,
                         shard_ids=tuple((e, None) for e in range(num_experts)))
        # Biases: gate/up's sharded as its rows, down's replicated (added by rank 0); under
        # expert parallelism both whole, of the local experts.
        for name, shape in (("gate_up_proj_bias", (count, 2 * local)),
                            ("down_proj_bias", (count, hidden_size))):
            param = nn.Parameter(torch.empty(shape), requires_grad=False) if bias else None
            self.register_parameter(name, param)
            if param is not None:
                set_weight_attrs(param, weight_loader=self.weight_loader, shard_ids=(None,))
        # Per expert (gate/up, down) packed weights it computes on instead (`set_packed`).
        self.packed: tuple[tuple[PackedWeight, PackedWeight], ...] | None = None

    def set_packed(self, experts: list[tuple[PackedWeight, PackedWeight]]) -> None:
        """Compute on `experts` (this rank's, whole: one rank, or expert parallelism) from now
        on; the float parameters are released (nothing reads them again)."""
        if len(experts) != self.num_local_experts or not (self.tp_size == 1
                                                          or self.expert_parallel):
            raise ValueError(f"packed experts: {len(experts)} for {self.num_local_experts} "
                             f"experts on tp {self.tp_size} (whole experts only: one rank or "
                             f"expert parallelism)")
        self.packed = tuple(experts)
        for name in ("gate_up_proj", "down_proj"):
            setattr(self, name, nn.Parameter(torch.empty(0), requires_grad=False))

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """This rank's part of a whole 3-D tensor or bias (shard None) or of one expert's
        projection (shard (expert, half)): its experts, whole, under expert parallelism (other
        ranks' per-expert tensors skipped); else its 1/tp of every expert's intermediate."""
        if shard_id is not None:
            self._load_expert(param, loaded, *shard_id)
            return
        if tensor_shape(loaded)[:1] != (self.num_experts,):
            raise ValueError(f"experts: checkpoint tensor has shape {tensor_shape(loaded)}, "
                             f"expected {self.num_experts} experts")
        if self.expert_parallel:  # its experts: the one narrow (a lazy slice takes one)
            loaded = narrow(loaded, 0, self.expert_start, self.num_local_experts)
        if param is self.down_proj_bias:  # replicated over the intermediate
            default_weight_loader(param, loaded, shard_id)
            return
        local, rank = self.local_intermediate, self.tp_rank
        is_down = param is self.down_proj
        axis = 2 if is_down else 1  # the intermediate dim (of the 3-D parameter)
        if self.checkpoint_layout == "interleaved_transposed":  # whole tensors only
            loaded = _as_stacked(materialize(loaded), is_down)
        count = self.num_local_experts if self.expert_parallel else self.num_experts
        full = ((count, self.hidden_size, self.intermediate_size) if is_down else
                (count, 2 * self.intermediate_size, self.hidden_size))
        full = full[:param.dim()]  # gate/up's bias: [E, 2I]
        if tensor_shape(loaded) != full:
            raise ValueError(f"experts: checkpoint tensor has shape "
                             f"{tensor_shape(loaded)}, expected {full}")
        with torch.no_grad():
            if self.expert_parallel or is_down:  # whole experts, or down's columns
                param.copy_(materialize(loaded if self.expert_parallel else
                                        narrow(loaded, axis, rank * local, local)))
                return
            for half in (0, 1):  # gate rows, then up rows
                start = half * self.intermediate_size + rank * local
                param[:, half * local:(half + 1) * local].copy_(
                    materialize(narrow(loaded, axis, start, local)))

    def _load_expert(self, param: nn.Parameter, loaded: Any, expert: int,
                     half: int | None) -> None:
        """One expert's gate (half 0), up (1) or down (None) projection, [I, H] / [H, I]."""
        is_down = param is self.down_proj
        full = ((self.hidden_size, self.intermediate_size) if is_down
                else (self.intermediate_size, self.hidden_size))
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert}: the layer has {self.num_experts} experts")
        if tensor_shape(loaded) != full:
            raise ValueError(f"expert {expert}: checkpoint tensor has shape "
                             f"{tensor_shape(loaded)}, expected {full}")
        index, local = expert - self.expert_start, self.local_intermediate
        if not 0 <= index < self.num_local_experts:
            return  # another rank's expert (expert parallelism)
        rows = loaded if self.expert_parallel else narrow(
            loaded, 1 if is_down else 0, self.tp_rank * local, local)
        with torch.no_grad():
            target = param[index] if is_down else param[index, half * local:(half + 1) * local]
            target.copy_(materialize(rows))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        """x [T, H], routing weights and (global) expert ids [T, k] -> [T, H] (all-reduced)."""
        # The Triton twin has no expert biases (gpt-oss's run the torch ops below).
        if self.packed is None and self.gate_up_proj_bias is None and platform.kernel_impl(
                x.device, portable_cpu_impl=True) == platform.TRITON:
            from mrv2.models.layers import moe_triton  # Triton is imported on first use only

            out = moe_triton.fused_moe(
                x, self.gate_up_proj, self.down_proj, weights, ids, self.act_and_mul,
                expert_start=self.expert_start if self.expert_parallel else None)
            return distributed.tp_all_reduce(out) if self.tp_size > 1 else out
        numba_experts = self._numba_experts(x)
        if numba_experts is not None:
            return numba_experts.forward(x, weights, ids)
        top_k, flat = ids.shape[1], ids.reshape(-1)
        mine = None  # the pairs this rank computes (None: all of them)
        if self.expert_parallel:  # its experts' pairs, their ids made local; others dropped
            flat = flat - self.expert_start
            mine = ((flat >= 0) & (flat < self.num_local_experts)).nonzero().squeeze(1)
            flat = flat[mine]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_local_experts).tolist()
        if mine is not None:
            order = mine[order]  # pair indices among all T * k
        tokens = order // top_k
        pair_weights = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start:start + count]
            gate_up_bias, down_bias = self.expert_biases(expert)
            if self.packed is not None:
                gate_up, down = self.packed[expert]
                hidden = self.act_and_mul(quantized_linear(x[rows], gate_up, gate_up_bias))
                y = quantized_linear(hidden, down, down_bias)
            else:
                hidden = self.act_and_mul(F.linear(x[rows], self.gate_up_proj[expert],
                                                   gate_up_bias))
                y = F.linear(hidden, self.down_proj[expert], down_bias)
            # An expert's rows are distinct tokens (top-k ids are distinct): an indexed add
            # is index_add_'s sum, without its CPU cost (milliseconds a call, threads waking).
            out[rows] += y * pair_weights[start:start + count, None]
            start += count
        return distributed.tp_all_reduce(out) if self.tp_size > 1 else out

    def _numba_experts(self, x: torch.Tensor):
        """The experts as moe_numba.NumbaExperts where it computes `x`'s rows (float32 CPU
        rows, few enough for its GEMVs, one rank, float32 or packed experts), else None."""
        from mrv2.models.cpu import moe_numba  # on the fused stack's weight views

        if not (x.device.type == "cpu" and x.dtype == torch.float32 and self.tp_size == 1
                and x.shape[0] <= moe_numba.MAX_NUMBA_EXPERT_ROWS
                and not torch.is_grad_enabled()
                and (self.packed is not None or self.gate_up_proj.dtype == torch.float32)):
            return None
        if self._numba is None or self._numba.key != self.storage_key():
            self._numba = moe_numba.NumbaExperts(self)
        return self._numba

    def storage_key(self) -> tuple:
        """What the experts' kernel views read: the parameters' storage, the packed weights."""
        params = (self.gate_up_proj, self.down_proj, self.gate_up_proj_bias, self.down_proj_bias)
        return (id(self.packed), *(0 if p is None else p.data_ptr() for p in params))

    def expert_biases(self, expert: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(gate/up's, down's) bias of local `expert` on this rank: None without biases, and
        down's None off rank 0 under tensor parallelism (the all-reduce adds rank 0's once;
        under expert parallelism one rank computes an expert's pairs, so it adds them)."""
        if self.gate_up_proj_bias is None:
            return None, None
        return (self.gate_up_proj_bias[expert], self.down_proj_bias[expert]
                if self.tp_rank == 0 or self.expert_parallel else None)

    def extra_repr(self) -> str:
        experts = (f"{self.num_local_experts} from {self.expert_start} (of {self.num_experts})"
                   if self.expert_parallel else f"{self.num_experts}")
        return (f"experts={experts}, hidden={self.hidden_size}, "
                f"intermediate={self.local_intermediate} (of {self.intermediate_size})")


class SparseMoE(nn.Module):
    """A MoE feed-forward block: `gate` (the router, replicated), `experts`, and optionally
    Qwen2-MoE's `shared_expert` (a gated MLP every token goes through) scaled by
    sigmoid(`shared_expert_gate`(x)). gpt-oss: a router bias (`router_bias`), the experts'
    own activation (`expert_activation`; None: `activation`) and FusedMoE's other keywords
    (`expert_options`: biases, activation arguments, checkpoint layout)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 intermediate_size: int, activation: str, renormalize: bool,
                 shared_intermediate_size: int = 0, *, router_bias: bool = False,
                 expert_activation: str | None = None, **expert_options: Any) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..{num_experts}")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Linear(hidden_size, num_experts, bias=router_bias)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size,
                                expert_activation or activation, **expert_options)
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
                     spec.activation, moe.renormalize, moe.shared_intermediate_size,
                     router_bias=moe.router_bias, expert_activation=moe.activation,
                     bias=moe.expert_bias, activation_kwargs=moe.activation_kwargs,
                     checkpoint_layout=moe.checkpoint_layout)
