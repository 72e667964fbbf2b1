"""MXFP4 weights as gpt-oss's safetensors checkpoints store its experts
(`quantization_config = {"quant_method": "mxfp4"}`; transformers' integrations/mxfp4.py):

- `<name>_blocks` uint8 [..., G, 16]: 32 e2m1 codes per group, two a byte, input 2j in the
  low nibble and 2j + 1 in the high one; a code is a sign bit and 3 bits indexing
  0, 0.5, 1, 1.5, 2, 3, 4, 6 (`FP4_VALUES`);
- `<name>_scales` uint8 [..., G]: one e8m0 exponent per 32 inputs, the group's values times
  2^(scale - 127).

Two readings, both exact (an e2m1 value times a power of two is a float32, and a bfloat16):
`dequantize` to float32 [..., G * 32], and `as_gguf_blocks`, ggml's MXFP4 blocks (GGUF type
39: the scale byte, then 16 bytes whose low nibbles are inputs 0..15 and high nibbles
16..31, values doubled against a scale halved: the same codes and exponent, only the nibble
order differs), which the packed-weight kernels compute on as stored
(layers/quant_formats.py's MXFP4 row). llama.cpp's converter repacks them the same way.
"""

from __future__ import annotations

import numpy as np
import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP_SIZE = 32  # inputs per scale
E8M0_BIAS = 127


def _codes(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [..., G, 16] -> the codes in input order, int64 [..., G, 32]."""
    blocks = blocks.to(torch.uint8)
    return torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2).long()


def _check_shapes(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.shape[-1] != GROUP_SIZE // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales "
                         f"{tuple(scales.shape)}: expected [..., G, 16] and [..., G]")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., G * 32] of a checkpoint's blocks and scales."""
    _check_shapes(blocks, scales)
    values = torch.tensor(FP4_VALUES, dtype=torch.float32)[_codes(blocks)]
    exponents = scales.to(torch.int32)[..., None] - E8M0_BIAS
    return torch.ldexp(values, exponents).flatten(-2)


def as_gguf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """uint8 [..., G * 17]: each group as ggml's block_mxfp4 (a row of a GGUF MXFP4 tensor)."""
    _check_shapes(blocks, scales)
    codes = _codes(blocks).to(torch.uint8)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    out = torch.cat([scales.to(torch.uint8)[..., None], qs], dim=-1)
    return np.ascontiguousarray(out.flatten(-2).numpy())
