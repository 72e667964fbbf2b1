"""The gated activations of the MLP block: gate_up [T, 2I] -> act(gate) * up [T, I].

SiLU-and-mul (Llama family): CUDA tensors run the fused Triton twin (activation_triton.py),
float32 CPU tensors outside autograd the fused numba twin (activation_numba.py), any other
tensor the torch ops. GeLU(tanh)-and-mul (Gemma's gelu_pytorch_tanh): the Triton twin on CUDA,
torch's own ops (transformers' function itself) elsewhere; the fused decode stack has its numba
kernel (activation_numba.gelu_tanh_and_mul_kernel).
SwiGLU-OAI (gpt-oss's experts, vLLM's "swigluoai"): the numba twin for float32 CPU tensors,
the torch ops elsewhere; its alpha and limit are the config's (MoESpec.activation_kwargs).

`GATED_ACTIVATIONS` maps a config's `hidden_act` / `hidden_activation` to its function."""

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


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if platform.kernel_impl(gate_up.device, portable_cpu_impl=True) == platform.TRITON:
        from mrv2.models.layers import activation_triton

        return activation_triton.gelu_tanh_and_mul(gate_up)
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def swigluoai_and_mul(gate_up: torch.Tensor, alpha: float = 1.702,
                      limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's experts' clamped SwiGLU (transformers' GptOssExperts._apply_gate, on gate
    and up de-interleaved at load): gate clamped to <= limit, up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate)."""
    if float32_cpu_inference(gate_up):
        return activation_numba.swigluoai_and_mul(gate_up, alpha, limit)
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul,
                     "swigluoai": swigluoai_and_mul}
