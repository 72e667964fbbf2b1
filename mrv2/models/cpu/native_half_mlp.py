"""The Llama MLP of a 16-bit model whose linears run on the CPU's matrix units, its gate/up
output and activation kept in bfloat16 between the two linears.

Why: on the layer path each such linear takes float32 x and gives float32 outputs
(`cpu_linear.native_16bit_linear` rounds x to bfloat16, and widens its bfloat16 outputs), so
between gate/up and down the step's largest activation made a float32 round trip that down
rounded again: two extra passes over it (bench/README.md has the measurement). Here SiLU-and-mul
reads gate/up's bfloat16 outputs and writes down's bfloat16 x
(`activation_numba.silu_and_mul_bf16`). The results are the layer path's, bit for bit: the
same roundings in the same places.

Steps of fewer rows than `quantized.MIN_NATIVE_HALF_ROWS` (the linears' GEMV), inputs outside
inference, and MLPs with biases run the module's own forward.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from mrv2.models.cpu.quantized_weights import bfloat16_weight
from mrv2.models.layers import activation_numba, cpu_linear, quantized
from mrv2.models.layers.quantized import QuantizedWeight


class NativeHalfMLP:
    """`forward` of one LlamaMLP whose gate/up and down projections compute on bfloat16
    weights that this CPU multiplies natively (`native_half_mlp` decides)."""

    def __init__(self, gate_up: QuantizedWeight, down: QuantizedWeight,
                 own_forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.gate_up, self.down, self.own_forward = gate_up, down, own_forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dim() != 2 or x.shape[0] < quantized.MIN_NATIVE_HALF_ROWS
                or x.dtype != torch.float32 or x.device.type != "cpu"
                or torch.is_grad_enabled()):
            return self.own_forward(x)
        gate_up = cpu_linear.half_linear(x.to(torch.bfloat16), self.gate_up.onednn_packed())
        act = activation_numba.silu_and_mul_bf16(gate_up)
        return cpu_linear.half_linear(act, self.down.onednn_packed()).float()


def native_half_mlp(mlp: nn.Module, own_forward: Callable[[torch.Tensor], torch.Tensor]
                    ) -> NativeHalfMLP | None:
    """A `NativeHalfMLP` for `mlp` (a LlamaMLP) where both projections were given bfloat16
    weights (quantized_weights), have no bias, and this CPU computes bfloat16 natively; else
    None."""
    gate_up, down = bfloat16_weight(mlp.gate_up_proj), bfloat16_weight(mlp.down_proj)
    if gate_up is None or down is None or not quantized.computes_natively(torch.bfloat16):
        return None
    return NativeHalfMLP(gate_up, down, own_forward)
