"""RMSNorm as in transformers' LlamaRMSNorm (and GemmaRMSNorm), with an optional fused
residual add."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mrv2 import platform
from mrv2.models.layers import norm_numba
from mrv2.models.layers.linear import default_weight_loader, materialize, set_weight_attrs
from mrv2.models.layers.numba_rows import float32_cpu_inference


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)).

    The normalisation runs in float32 and is cast back to the input dtype before the weight
    multiply, the same order as transformers, so low-precision outputs round identically.
    CUDA tensors run the fused Triton twin (norm_triton.py), float32 CPU tensors the numba twin
    (norm_numba.py), any other tensor the torch ops below.

    `unit_offset` (Gemma): the checkpoint stores w and the norm multiplies by 1 + w, in
    float32 and rounded once to the input dtype (GemmaRMSNorm's order). `weight` then holds
    1 + w in float32 whatever the model's dtype (made at load), so every path multiplies by the
    same values.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.unit_offset = unit_offset
        if unit_offset:
            self.weight = nn.Parameter(torch.empty(hidden_size, dtype=torch.float32),
                                       requires_grad=False)
            set_weight_attrs(self.weight, weight_loader=_unit_offset_loader, shard_ids=(None,))
        else:
            self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
            set_weight_attrs(self.weight, weight_loader=default_weight_loader,
                             shard_ids=(None,))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        if self.unit_offset:
            return (h * self.weight).to(input_dtype)
        return self.weight * h.to(input_dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual), where the
        second value is the residual stream the next layer adds its output to."""
        if platform.kernel_impl(x.device, portable_cpu_impl=True) == platform.TRITON:
            from mrv2.models.layers import norm_triton  # Triton is imported on first use only

            return norm_triton.rms_norm(x, self.weight, self.eps, residual, self.unit_offset)
        if float32_cpu_inference(x, self.weight, *(() if residual is None else (residual,))):
            return norm_numba.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        # Added in the activation dtype, as transformers' `residual + hidden_states`.
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, unit_offset={self.unit_offset}"


def pre_norm(norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's input norm: (norm(hidden + residual), hidden + residual), where the
    first layer (`residual` None) starts the residual stream with its input."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


def _unit_offset_loader(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
    """A Gemma norm's checkpoint w stored as 1 + w in float32 (GemmaRMSNorm's
    `1.0 + self.weight.float()`)."""
    default_weight_loader(param, 1.0 + materialize(loaded).float(), shard_id)
