"""Test helpers for packed weights (mrv2/models/layers/quantized.py)."""

from __future__ import annotations

import torch

from mrv2.models.layers.quantized import PackedWeight


def dequantized(weight: PackedWeight) -> torch.Tensor:
    """The whole float32 weight [N, K], each row as the embedding lookup dequantizes it (the
    kernels never need it: references only)."""
    return weight.dequantize_rows(torch.arange(weight.out_features))
