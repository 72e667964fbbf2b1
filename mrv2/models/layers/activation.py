"""SiLU-and-mul, the gated activation of the Llama-family MLP: gate_up [T, 2I] -> silu(gate) *
up [T, I]. CUDA tensors run the fused Triton twin (activation_triton.py), float32 CPU tensors
outside autograd the fused numba twin (activation_numba.py), any other tensor the torch ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mrv2 import platform
from mrv2.models.layers import activation_numba
from mrv2.models.layers.numba_rows import float32_cpu_inference


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if platform.kernel_impl(gate_up.device, portable_cpu_impl=True) == platform.TRITON:
        from mrv2.models.layers import activation_triton  # Triton is imported on first use only

        return activation_triton.silu_and_mul(gate_up)
    if float32_cpu_inference(gate_up):
        return activation_numba.silu_and_mul(gate_up)
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up
