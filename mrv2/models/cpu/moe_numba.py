"""The numba twin of moe.py's experts, float32 on the CPU: each row routed to its top-k
experts and their gated MLPs summed, as moe.py's torch path computes it, on the fused decode
stack's weight views (models/cpu/stack_views_numba.py: float32, 16-bit or GGUF / MXFP4 blocks,
one per expert). The stack calls `moe_block` (router, routing, experts) inside its one call per
step (models/cpu/decode_stack_numba.py); FusedMoE's forward calls `experts_block` through
`NumbaExperts` for steps of up to MAX_NUMBA_EXPERT_ROWS rows (a step the stack does not take:
a float32 model's 5-32 decode rows, short prompts), one call instead of a Python step per
expert (beyond, each expert has rows enough for the tiled / oneDNN linears).

Same arithmetic and order as the torch path: the router's logits by the stack's linear (plus
gpt-oss's bias), softmax in float32, the top-k (ties to the lowest expert id), renormalised
where the model says so; then expert by expert in id order, the rows routed to it gathered,
its gate/up and down linears run on those rows only (each plus its bias: gpt-oss), and each
output row, times its routing weight, added to the block's output. At batch 1 only the chosen
experts' weights are read.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from mrv2.models.cpu.stack_views_numba import NO_MATRIX, stack_linear, weight_view
from mrv2.models.layers.activation_numba import (gelu_tanh_and_mul_kernel, silu_and_mul_kernel,
                                                 swigluoai_and_mul_kernel)
from mrv2.models.layers.numba_exp import exp32
from mrv2.models.layers.numba_rows import typed_list
from mrv2.utils.kernel_flags import FASTMATH


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def route_rows(logits, top_k, renormalize, weights, ids):
    """Each row's top-k experts (`ids` [rows, k], by descending probability, ties to the lower
    id) and their softmax probabilities (`weights` [rows, k], float32), rescaled to sum to 1
    where `renormalize`: layers/moe.route on `logits` [rows, experts]."""
    rows, experts = logits.shape
    probs = np.empty(experts, dtype=np.float32)
    taken = np.empty(experts, dtype=np.bool_)
    for r in range(rows):
        top = logits[r, 0]
        for e in range(1, experts):
            top = max(top, logits[r, e])
        total = np.float32(0.0)
        for e in range(experts):
            probs[e] = exp32(logits[r, e] - top)
            total += probs[e]
            taken[e] = False
        chosen = np.float32(0.0)
        for j in range(top_k):
            best = -1
            for e in range(experts):
                if not taken[e] and (best < 0 or probs[e] > probs[best]):
                    best = e
            taken[best] = True
            ids[r, j] = best
            weights[r, j] = probs[best] / total
            chosen += weights[r, j]
        if renormalize:
            for j in range(top_k):
                weights[r, j] /= chosen


# The experts' gated activation (`moe_block`'s `activation[0]`).
EXPERTS_SILU, EXPERTS_GELU_TANH, EXPERTS_SWIGLU_OAI = 0, 1, 2


@njit(cache=True)
def _add_row(out, r, bias, b):
    """out[r] += bias[b] (a [0, 0] bias: none), after the product, as the torch path adds it."""
    if bias.shape[0] > 0:
        for i in range(out.shape[1]):
            out[r, i] += bias[b, i]


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def moe_block(x, router, router_bias, gate_ups, downs, gate_up_bias, down_bias, top_k,
              renormalize, intermediate, activation, out):
    """out [rows, hidden] = the routed experts' weighted sum for the rows of `x` (overwritten):
    `router` a float32 [experts, hidden] weight and `router_bias` [1, experts] ([0, 0]: none),
    routed by `route_rows`, then `experts_block`."""
    rows = x.shape[0]
    experts = router.shape[0]
    logits = np.empty((rows, experts), dtype=np.float32)
    stack_linear(x, router, logits)
    for r in range(rows):
        _add_row(logits, r, router_bias, 0)
    weights = np.empty((rows, top_k), dtype=np.float32)
    ids = np.empty((rows, top_k), dtype=np.int64)
    route_rows(logits, top_k, renormalize, weights, ids)
    experts_block(x, weights, ids, gate_ups, downs, gate_up_bias, down_bias, intermediate,
                  activation, out)


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def experts_block(x, weights, ids, gate_ups, downs, gate_up_bias, down_bias, intermediate,
                  activation, out):
    """out [rows, hidden] = sum over each row's k experts `ids` [rows, k] of its routing weight
    `weights` [rows, k] times the expert's gated MLP of the row (overwritten): `gate_ups` /
    `downs` each expert's weight view (gate rows then up rows [2 * intermediate, hidden];
    [hidden, intermediate]) and their biases per expert ([experts, 2 * intermediate] and
    [experts, hidden]; [0, 0]: none); `activation` (code, alpha, limit): EXPERTS_SILU,
    EXPERTS_GELU_TANH or EXPERTS_SWIGLU_OAI (gpt-oss's clamped SwiGLU, its alpha and limit)."""
    rows, hidden = x.shape
    top_k = ids.shape[1]
    out[:] = 0.0
    pairs = np.empty(rows * top_k, dtype=np.int64)  # the (row * k + j) routed to one expert
    for e in range(len(gate_ups)):
        count = 0
        for p in range(rows * top_k):
            if ids[p // top_k, p % top_k] == e:
                pairs[count] = p
                count += 1
        if count == 0:
            continue
        rows_in = np.empty((count, hidden), dtype=np.float32)
        for c in range(count):
            rows_in[c] = x[pairs[c] // top_k]
        gate_up = np.empty((count, 2 * intermediate), dtype=np.float32)
        stack_linear(rows_in, gate_ups[e], gate_up)
        for c in range(count):
            _add_row(gate_up, c, gate_up_bias, e)
        act = np.empty((count, intermediate), dtype=np.float32)
        code, alpha, limit = activation
        if code == EXPERTS_SWIGLU_OAI:
            swigluoai_and_mul_kernel(gate_up, intermediate, alpha, limit, act)
        elif code == EXPERTS_GELU_TANH:
            gelu_tanh_and_mul_kernel(gate_up, intermediate, act)
        else:
            silu_and_mul_kernel(gate_up, intermediate, act)
        expert_out = np.empty((count, hidden), dtype=np.float32)
        stack_linear(act, downs[e], expert_out)
        for c in range(count):
            _add_row(expert_out, c, down_bias, e)
        for c in range(count):
            row, weight = pairs[c] // top_k, weights[pairs[c] // top_k, pairs[c] % top_k]
            for i in range(hidden):
                out[row, i] += expert_out[c, i] * weight


# The experts' activations the kernels compute -> the code; their keyword arguments (the
# clamped SwiGLU's) and defaults.
EXPERT_ACTIVATIONS = {"silu": EXPERTS_SILU, "gelu_pytorch_tanh": EXPERTS_GELU_TANH,
                      "swigluoai": EXPERTS_SWIGLU_OAI}
EXPERT_ACTIVATION_ARGUMENTS = {"alpha": 1.702, "limit": 7.0}


def activation_args(name: str, kwargs: dict[str, float]) -> tuple:
    """`experts_block`'s `activation` of an activation name and its keyword arguments."""
    values = {**EXPERT_ACTIVATION_ARGUMENTS, **kwargs}
    return (np.int64(EXPERT_ACTIVATIONS[name]), np.float32(values["alpha"]),
            np.float32(values["limit"]))


def expert_weights(experts) -> list[tuple]:
    """Each expert's (gate/up, down) of a FusedMoE as the kernels read them: its packed weights,
    or the float32 parameters' slices."""
    if experts.packed is not None:
        return list(experts.packed)
    return [(experts.gate_up_proj[e], experts.down_proj[e])
            for e in range(experts.num_local_experts)]


# The most rows FusedMoE's CPU forward runs here (numba_experts): the experts' linears are
# GEMVs (few rows each: ~rows * k / E), as the decode stack's.
MAX_NUMBA_EXPERT_ROWS = 32


class NumbaExperts:
    """A FusedMoE's experts as `experts_block` reads them (one rank, float32 or packed), built
    once from its weights: `forward(x, weights, ids)` for up to MAX_NUMBA_EXPERT_ROWS float32
    CPU rows, in one call instead of a Python step per expert."""

    def __init__(self, experts) -> None:
        pairs = expert_weights(experts)
        self.gate_ups = typed_list(tuple(weight_view(gate_up) for gate_up, _ in pairs))
        self.downs = typed_list(tuple(weight_view(down) for _, down in pairs))
        self.biases = tuple(NO_MATRIX if b is None else b.detach().numpy()
                            for b in (experts.gate_up_proj_bias, experts.down_proj_bias))
        self.width = np.int64(experts.local_intermediate)
        self.activation = activation_args(experts.activation, experts.activation_kwargs)
        # what the views read: a parameter given new storage rebuilds them (`current`)
        self.key = experts.storage_key()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        out = torch.empty_like(x)
        experts_block(x.contiguous().numpy(), weights.contiguous().numpy(),
                      ids.contiguous().numpy(), self.gate_ups, self.downs, *self.biases,
                      self.width, self.activation, out.numpy())
        return out
