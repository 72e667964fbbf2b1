"""models/mxfp4: the checkpoint's MXFP4 bit layout read as transformers reads it (its
integrations/mxfp4.py dequantization, bit for bit), ggml's MXFP4 blocks made from it holding
the same values (gguf.quants and the packed weight's dequantization, bit for bit), the
reference quantizer's round trip, and the shape errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from mrv2.models.layers.quantized import PackedWeight
from mrv2.models.mxfp4 import as_gguf_blocks, dequantize
from tests.models.mxfp4_helpers import quantize
from tests.models.quantized_helpers import dequantized


def _random(experts: int, rows: int, groups: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=gen).to(torch.uint8)
    scales = torch.randint(110, 135, (experts, rows, groups), generator=gen).to(torch.uint8)
    return blocks, scales


def test_dequantize_is_transformers_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random(3, 10, 4, seed=0)
    ours = dequantize(blocks, scales)
    assert ours.shape == (3, 10, 128) and ours.dtype == torch.float32
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(ours, theirs.transpose(1, 2))


def test_gguf_blocks_hold_the_same_values():
    blocks, scales = _random(2, 6, 3, seed=1)
    raw = as_gguf_blocks(blocks, scales)
    assert raw.shape == (2, 6, 3 * 17) and raw.dtype == np.uint8
    want = dequantize(blocks, scales)
    ref = gguf.quants.dequantize(raw[0], gguf.GGMLQuantizationType.MXFP4)
    assert torch.equal(torch.from_numpy(np.ascontiguousarray(ref, np.float32)), want[0])
    packed = PackedWeight.from_gguf(raw[1], "MXFP4", (6, 96))
    assert torch.equal(dequantized(packed), want[1])


def test_reference_quantizer_round_trip():
    """Each value within 2 s of its group's scale s (e2m1's widest spacing, 2, halved; or
    a group's largest, below 8 s, clipped to 6 s); dequantized values come back unchanged."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(4, 96, generator=gen)
    blocks, scales = quantize(w)
    back = dequantize(blocks, scales)
    s = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
    assert ((back - w).abs() <= 2 * s).all()
    assert torch.equal(dequantize(*quantize(back)), back)


def test_shapes_are_checked():
    blocks, scales = _random(1, 2, 3, seed=3)
    with pytest.raises(ValueError, match="expected"):
        dequantize(blocks, scales[..., :2])
    with pytest.raises(ValueError, match="expected"):
        as_gguf_blocks(blocks[..., :8], scales)
